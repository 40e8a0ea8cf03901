"""Expert-parallel peers in lockstep: an evaluation set sharded over the dense data-parallel
group with EP > 1 gives EP peers different batch counts (NVIDIA Model-Optimizer PR 1966).

The planted run is megatron's ``tp=2, ep=4, etp=1`` on 8 ranks: EP groups ``(0, 1, 2, 3)`` and
``(4, 5, 6, 7)`` span dense data-parallel ranks 0-1 and 2-3. Seven evaluation batches dealt out
over the 4 data-parallel ranks leave data-parallel rank 3 (ranks 6 and 7) one batch short, so
ranks 4 and 5 enter an all-to-all that ranks 6 and 7 never reach.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshsim
from meshsim import CollectiveDivergence, DataflowMismatch, record_batches

EXP = meshsim.expect(
    "megatron",
    8,
    tensor_model_parallel_size=2,
    expert_model_parallel_size=4,
    expert_tensor_parallel_size=1,
)
BATCH = 2
LEAD = (
    "expert-parallel group (4, 5, 6, 7) of expert:ep ran out of lockstep: its ranks recorded "
    "different step counts (rank 4: 2, rank 5: 2, rank 6: 1, rank 7: 1); at step 1 ranks 4, 5 "
    "wait in an all-to-all that ranks 6, 7 never enter. Likely mistake: evaluation sharded over "
    "the dense data-parallel group with EP > 1: EP peers must run the same number of steps or "
    "the all-to-all hangs"
)


def _evaluate(batches: int, *, drop_last: bool, exchange: bool) -> meshsim.BatchRecord:
    """megatron_mmlu's loop before the fix: batch ``i`` goes to data-parallel rank ``i % dp``;
    each batch's tokens then cross the EP group by all-to-all (when ``exchange``)."""
    dense = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    experts = init_device_mesh("cpu", (2, 4), mesh_dim_names=("edp", "ep"))
    dp, ep = dense["dp"], experts["ep"]
    rounds = batches // dp.size() if drop_last else -(-batches // dp.size())
    rec = record_batches()
    for index in range(min(batches, rounds * dp.size())):
        if index % dp.size() != dp.get_local_rank():
            continue
        ids = list(range(BATCH * index, BATCH * (index + 1)))
        rec.add(ids)
        if exchange:  # route one token per sample to every expert's rank
            tokens = torch.tensor(ids, dtype=torch.float32).repeat_interleave(ep.size())
            dist.all_to_all_single(torch.empty_like(tokens), tokens, group=ep.get_group())
    return rec


def test_the_meshes_are_the_references() -> None:
    """The program builds the reference's groups: only the sharding is wrong."""

    def groups() -> tuple[list[int], list[int]]:
        dense = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        experts = init_device_mesh("cpu", (2, 4), mesh_dim_names=("edp", "ep"))
        return dense["dp"].mesh.tolist(), experts["ep"].mesh.tolist()

    for rank, (dp, ep) in enumerate(meshsim.run(groups, 8, backend="threaded")):
        assert dp == list(EXP.group_of(rank, "data_parallel"))
        assert ep == list(EXP.group_of(rank, "expert"))


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_uneven_evaluation_shards_break_ep_lockstep(backend: str) -> None:
    records = meshsim.run(
        _evaluate, 8, backend=backend, kwargs={"batches": 7, "drop_last": False, "exchange": False}
    )
    with pytest.raises(DataflowMismatch) as info:
        meshsim.assert_data_parallel(records, EXP)
    assert str(info.value).splitlines()[0].startswith(LEAD)
    assert "shard over the expert-data-parallel group (expert:dp) instead" in str(info.value)
    assert info.value.problems == [str(info.value).splitlines()[0]]


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_the_same_loop_with_its_all_to_all_stops_where_the_check_said(backend: str) -> None:
    """Run for real, the all-to-all the check predicts is the one left without partners; the
    harness proves the divergence from its recordings and stops the run (no 600 s wait)."""
    with pytest.raises(CollectiveDivergence) as info:
        meshsim.run(
            _evaluate,
            8,
            backend=backend,
            kwargs={"batches": 7, "drop_last": False, "exchange": True},
            timeout=120,
        )
    first = str(info.value).splitlines()[0]
    assert "on group (4,5,6,7)" in first, first
    assert "rank 4 called all_to_all_single on group (4,5,6,7)" in str(info.value)


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
@pytest.mark.parametrize(
    ("batches", "drop_last", "steps"), [(8, False, 2), (7, True, 1)], ids=["even", "drop_last"]
)
def test_even_evaluation_shards_keep_ep_peers_in_lockstep(
    backend: str, batches: int, drop_last: bool, steps: int
) -> None:
    records = meshsim.run(
        _evaluate,
        8,
        backend=backend,
        kwargs={"batches": batches, "drop_last": drop_last, "exchange": True},
    )
    assert [len(r.steps) for r in records] == [steps] * 8
    meshsim.assert_data_parallel(records, EXP)


def test_ep_peers_with_one_data_parallel_rank_blame_the_loop() -> None:
    """EP built from TP peers (megatron tp=2, ep=2, etp=1): EP peers share the data-parallel
    rank, so a count that differs comes from a rank-dependent loop, not from the sharding."""
    expected = meshsim.expect(
        "megatron",
        4,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    assert expected.groups("expert") == expected.groups("tensor")
    records = [record_batches([[r // 2], [2 + r // 2]], rank=r) for r in range(4)]
    meshsim.assert_data_parallel(records, expected)
    records[1].steps.pop()
    with pytest.raises(DataflowMismatch) as info:
        meshsim.assert_data_parallel(records, expected)
    lead = str(info.value).splitlines()[0]
    assert lead.startswith("expert-parallel group (0, 1) of expert:ep ran out of lockstep")
    assert "at step 1 rank 0 waits in an all-to-all that rank 1 never enters" in lead
    assert "a step count or early exit that depends on the rank" in lead
    assert "dense data-parallel group" not in lead


def test_uneven_counts_outside_any_ep_group_keep_the_world_rule() -> None:
    """megatron ep=2 on 4 ranks: EP groups (0, 1), (2, 3) each even, the world not; the
    lockstep check stays silent and the world rule names the short ranks."""
    expected = meshsim.expect("megatron", 4, expert_model_parallel_size=2)
    records = [record_batches([[s] for s in range(6)[r::4]], rank=r) for r in range(4)]
    with pytest.raises(DataflowMismatch, match="ranks 2, 3 recorded fewer steps") as info:
        meshsim.assert_data_parallel(records, expected)
    assert "expert-parallel" not in str(info.value)
