"""verl convention: FSDP engine meshes, the Ulysses mesh, dispatch/collect, the torchtitan
engine's data rank, refusals, and the findings (verl#7493, CP peers dispatched apart)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import LayoutError
from meshsim.dataflow.roles import data_index, gradient_groups
from meshsim.model.conventions import verl
from meshsim.model.sweep import divisors


def v(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("verl", world, **config)


def dispatch_ranks(exp: meshsim.Expected) -> dict[int, int]:
    """rank -> the batch chunk it receives (chunks numbered as the controller numbers them)."""
    index = data_index(exp)
    return {rank: index[rank] for rank in range(exp.world_size)}


def test_default_is_one_fsdp_group_and_every_worker_its_own_chunk() -> None:
    exp = v(8)
    assert exp.layout is not None and exp.layout.dim_names == ("fsdp",)
    world = [tuple(range(8))]
    for kind in ("device_mesh", "fsdp", "fsdp_reduce", "get_data_parallel_group", "collect"):
        assert exp.groups(kind) == world
    assert exp.groups("dispatch") == [(r,) for r in range(8)]
    assert set(exp.unavailable()) == {"ddp", "dp", "sp"}
    assert exp.unavailable()["ddp"].upstream == "KeyError"


def test_fsdp_size_makes_an_hsdp_mesh_that_still_reduces_over_the_world() -> None:
    exp = v(8, fsdp_size=4)
    assert exp.groups("fsdp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("ddp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("fsdp_reduce") == [tuple(range(8))]
    assert exp.kind("fsdp_reduce").mesh_dims == ("ddp", "fsdp")


@pytest.mark.parametrize("size", [-1, 8, 9])
def test_fsdp_size_negative_or_at_least_the_world_is_one_dim(size: int) -> None:
    assert v(8, fsdp_size=size).groups("fsdp") == [tuple(range(8))]


def test_verl_7493_fsdp1_with_fsdp_size_1_reduces_over_no_one() -> None:
    """(ddp, fsdp) = (8, 1): FSDP1 clamps HYBRID_SHARD to NO_SHARD on the 1-rank shard group."""
    fsdp1 = v(8, fsdp_size=1)
    assert fsdp1.groups("fsdp_reduce") == [(r,) for r in range(8)]
    assert gradient_groups(fsdp1) == [(r,) for r in range(8)]
    # ... while all 8 ranks load different chunks: each trains its own model.
    assert sorted(dispatch_ranks(fsdp1).values()) == list(range(8))
    fsdp2 = v(8, fsdp_size=1, strategy="fsdp2")
    assert fsdp2.groups("fsdp_reduce") == [tuple(range(8))]


def test_ulysses_mesh_sets_the_data_rank_and_collects_from_sp_rank_0() -> None:
    exp = v(8, fsdp_size=2, ulysses_sequence_parallel_size=4)
    assert exp.meshes["ulysses"].dim_names == ("dp", "sp")
    assert exp.groups("sp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("get_data_parallel_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("dispatch") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("collect") == [(0, 4)]
    assert exp.group_of(5, "collect") is None
    assert exp.roles["context"] == "sp"
    assert dispatch_ranks(exp) == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    assert exp.groups("fsdp_reduce") == [tuple(range(8))]  # sp peers reduce together


def test_torchtitan_data_rank_is_the_loss_mesh() -> None:
    exp = v(8, strategy="torchtitan", data_parallel_shard_size=4, tensor_parallel_size=2)
    assert exp.groups("get_data_parallel_group") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("dispatch") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("collect") == [(0, 2, 4, 6)]
    assert exp.roles["tensor"] == "tp"


def test_torchtitan_cp_peers_are_dispatched_different_chunks() -> None:
    """Finding: verl's data rank is the (batch, cp) loss mesh's, so CP peers get different
    chunks (4 chunks for 2 data-parallel replicas), and only cp rank 0's outputs come back."""
    exp = v(4, strategy="torchtitan", data_parallel_shard_size=2, context_parallel_size=2)
    assert exp.groups("cp") == [(0, 1), (2, 3)]
    assert dispatch_ranks(exp) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert exp.groups("collect") == [(0, 2)]


def collected_in_chunk_order(exp: meshsim.Expected) -> bool:
    chunks = dispatch_ranks(exp)
    collected = exp.groups("collect")[0]
    return [chunks[r] for r in collected] == list(range(len(set(chunks.values()))))


def test_fsdp_engine_collects_one_output_per_chunk_in_order() -> None:
    for case in meshsim.layouts(8, "verl", torchtitan=False):
        assert collected_in_chunk_order(case.expect()), case


def test_torchtitan_collect_drops_chunks_only_with_cp() -> None:
    for case in meshsim.layouts(8, "verl"):
        if case.config.get("strategy") == "torchtitan":
            has_cp = case.config.get("context_parallel_size", 1) > 1
            assert collected_in_chunk_order(case.expect()) is not has_cp, case


@pytest.mark.parametrize(
    ("config", "upstream"),
    [
        *[(c, u) for c, u in zip(verl.refused_configs(8), ["ZeroDivisionError"] * 2)],
        ({"ulysses_sequence_parallel_size": 16}, "AssertionError"),
        ({"strategy": "torchtitan", "data_parallel_shard_size": 16}, "AssertionError"),
        ({"strategy": "torchtitan", "tensor_parallel_size": 8}, "ValueError"),
        ({"fsdp_size": 3}, "IndexError"),
        ({"ulysses_sequence_parallel_size": 3}, "IndexError"),
        ({"strategy": "megatron"}, None),
        ({"strategy": "torchtitan", "fsdp_size": 2}, None),
        ({"tensor_parallel_size": 2}, None),
        ({"ulysses_sequence_parallel_size": -2}, None),
    ],
    ids=str,
)
def test_refusals_name_verls_exception(config: dict[str, Any], upstream: str | None) -> None:
    with pytest.raises(LayoutError) as refused:
        v(8, **config)
    assert refused.value.upstream == upstream


def test_every_listed_refusal_is_refused() -> None:
    for config in verl.refused_configs(8):
        with pytest.raises(LayoutError):
            v(8, **config)


def test_sweep_size_and_validity() -> None:
    cases = meshsim.layouts(8, "verl")
    assert len(cases) == 57
    assert len(meshsim.layouts(8, "verl", torchtitan=False)) == 32


def test_a_million_ranks_answer_fast() -> None:
    exp = v(2**20, fsdp_size=8, ulysses_sequence_parallel_size=4)
    assert exp.group_of(2**20 - 1, "sp") == tuple(range(2**20 - 4, 2**20))
    assert exp.group_of(7, "fsdp_reduce") is not None


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 4, 6, 8, 12]), st.data())
def test_ulysses_peers_share_a_chunk_and_reduce_together(world: int, data: st.DataObject) -> None:
    sp = data.draw(st.sampled_from(divisors(world)))
    fsdp = data.draw(st.sampled_from((-1, *divisors(world)[1:])))
    strategy = data.draw(st.sampled_from(["fsdp", "fsdp2"]))
    exp = v(world, strategy=strategy, fsdp_size=fsdp, ulysses_sequence_parallel_size=sp)
    chunks = dispatch_ranks(exp)
    reduce = exp.groups("fsdp_reduce")
    for rank in range(world):
        peers = exp.group_of(rank, "dispatch")
        assert {chunks[p] for p in peers} == {chunks[rank]}
        assert set(peers) <= set(exp.group_of(rank, "fsdp_reduce"))
    assert sorted(r for g in reduce for r in g) == list(range(world))
