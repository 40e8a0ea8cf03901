"""assert_data_parallel on hand-made records: each rule, each diagnosis, each usage error."""

from __future__ import annotations

import random

import pytest
import torch

import meshsim
from meshsim import DataflowMismatch, UsageError, record_batches
from tests.releases import needs_unflatten

# OLMo-core dp 2 x cp 2 x tp 2: data groups (0, 4), (1, 5), ...; gradient groups (0, 2, 4, 6), ...
EXP = meshsim.expect("olmo-core", 8, dp="fsdp", cp=2, tp=2)


def _dp(rank: int) -> int:
    return int(rank >= 4)


def _correct(steps: int = 2) -> list[meshsim.BatchRecord]:
    return [
        record_batches(
            [[10 * s + 2 * _dp(r), 10 * s + 2 * _dp(r) + 1] for s in range(steps)], rank=r
        )
        for r in range(8)
    ]


def test_correct_records_pass_with_the_global_batch() -> None:
    meshsim.assert_data_parallel(_correct(), EXP, global_batches=[[0, 1, 2, 3], [10, 11, 12, 13]])


def test_sampler_over_the_gradient_group_names_cp_peers_and_the_mistake() -> None:
    position = {r: EXP.group_of(r, "gradient_reduce").index(r) for r in range(8)}
    records = [record_batches([[position[r]], [4 + position[r]]], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch) as info:
        meshsim.assert_data_parallel(records, EXP)
    message = str(info.value)
    assert "step 0: ranks 0 and 2 are CP peers" in message
    assert "rank 0 [0], rank 2 [1]" in message
    assert "split over the gradient group get_dp_model_mesh" in message
    assert len(info.value.problems) == 1  # one finding per rank pair, not one per step


def test_tp_peers_with_different_seeds_are_blamed_on_the_seed() -> None:
    def batch(rank: int, step: int) -> list[int]:
        order = list(range(8))
        random.Random(rank % 2).shuffle(order)  # the seed depends on the TP rank
        shard = order[_dp(rank) :: 2]
        return shard[2 * step : 2 * step + 2]

    records = [record_batches([batch(r, 0), batch(r, 1)], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch, match="ranks 0 and 1 are TP peers") as info:
        meshsim.assert_data_parallel(records, EXP)
    assert "different random seeds" in str(info.value)


def test_unsplit_sampler_and_repeats_are_caught() -> None:
    records = [record_batches([[0, 1], [0, 1]], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch) as info:
        meshsim.assert_data_parallel(records, EXP)
    text = str(info.value)
    assert "data-parallel ranks 0 and 4 (group 0, 4) both loaded samples [0, 1]" in text
    assert "not split over the data-parallel group" in text
    assert "sample 0 loaded twice in epoch 0: by rank 0 at step 0 and by rank 0 at step 1" in text


def test_a_new_epoch_may_repeat_samples() -> None:
    records = [
        record_batches([[2 * _dp(r)], [2 * _dp(r)]], epochs=[0, 1], rank=r) for r in range(8)
    ]
    meshsim.assert_data_parallel(records, EXP)


def test_missing_samples_of_the_global_batch_are_named() -> None:
    with pytest.raises(DataflowMismatch, match=r"missing \[99\]"):
        meshsim.assert_data_parallel(_correct(1), EXP, global_batches=[[0, 1, 2, 3, 99]])


def test_uneven_step_counts_are_a_hang_waiting_to_happen() -> None:
    records = _correct(2)
    records[5].steps.pop()
    with pytest.raises(DataflowMismatch, match="ranks 5 recorded fewer steps"):
        meshsim.assert_data_parallel(records, EXP)


def test_context_chunks_must_differ_between_cp_peers_and_match_between_tp_peers() -> None:
    def chunk(rank: int) -> tuple[int, int]:
        cp = EXP.local_rank(rank, "context")
        return (4 * cp, 4 * cp + 4)

    good = [record_batches([[2 * _dp(r)]], chunks=[chunk(r)], rank=r) for r in range(8)]
    meshsim.assert_data_parallel(good, EXP, context_chunks=True)
    same = [record_batches([[2 * _dp(r)]], chunks=[(0, 8)], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch, match="CP peers 0 and 2 hold the same chunk"):
        meshsim.assert_data_parallel(same, EXP, context_chunks=True)
    tp_split = [record_batches([[2 * _dp(r)]], chunks=[(r, r + 1)], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch, match="TP peers in the same context-parallel position"):
        meshsim.assert_data_parallel(tp_split, EXP, context_chunks=True)


def test_tensor_batches_are_fingerprinted_row_by_row() -> None:
    rows = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert meshsim.dataflow.records.sample_ids(rows) == meshsim.dataflow.records.sample_ids(
        rows.clone()
    )
    good = [record_batches([rows[2 * _dp(r) : 2 * _dp(r) + 2]], rank=r) for r in range(8)]
    meshsim.assert_data_parallel(good, EXP)
    bad = [record_batches([rows[r % 4 : r % 4 + 1]], rank=r) for r in range(8)]
    with pytest.raises(DataflowMismatch, match="ranks 0 and 1 are TP peers"):
        meshsim.assert_data_parallel(bad, EXP)


@needs_unflatten
def test_no_data_parallelism_means_every_rank_loads_the_same_batch() -> None:
    exp = meshsim.expect("torchtitan", 8, dp_shard=1, cp=2, tp=4)
    assert "data_parallel" not in exp.roles
    meshsim.assert_data_parallel([record_batches([[7]], rank=r) for r in range(8)], exp)
    with pytest.raises(DataflowMismatch, match="ranks 0 and 3"):
        meshsim.assert_data_parallel(
            [record_batches([[7 if r != 3 else 8]], rank=r) for r in range(8)], exp
        )


@pytest.mark.parametrize(
    ("records", "match"),
    [
        ([record_batches([[0]], rank=r) for r in range(7)], "no record for ranks 7"),
        ([record_batches([[0]], rank=0)] * 8, "two records for rank 0"),
        (["not a record"], "records must be BatchRecord"),
    ],
)
def test_bad_records_are_usage_errors(records: list, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        meshsim.assert_data_parallel(records, EXP)


def test_record_batches_rejects_what_it_cannot_read() -> None:
    with pytest.raises(UsageError, match="sequence of sample ids"):
        record_batches([42], rank=0)
    with pytest.raises(UsageError, match=r"torch\.distributed"):
        record_batches([[1]])
    with pytest.raises(UsageError, match="chunks has 1 entries for 2 steps"):
        record_batches([[1], [2]], chunks=[(0, 1)], rank=0)
