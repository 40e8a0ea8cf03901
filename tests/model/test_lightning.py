"""Lightning ModelParallelStrategy convention: the (data_parallel, tensor_parallel) mesh,
"auto" sizes, refusals, and properties over every split."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import lightning
from meshsim.model.sweep import divisors


def lit(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("lightning", world, **config)


def test_explicit_split_puts_tensor_parallel_peers_on_consecutive_ranks() -> None:
    exp = lit(8, data_parallel_size=2, tensor_parallel_size=4)
    assert exp.groups("tensor_parallel") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("data_parallel") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.layout is not None
    assert exp.layout.dim_names == ("data_parallel", "tensor_parallel")


def test_auto_sizes_are_nodes_by_processes_per_node() -> None:
    assert dict(lit(8).config) == {
        "data_parallel_size": 1,
        "tensor_parallel_size": 8,
        "num_nodes": 1,
    }
    two_nodes = lit(8, num_nodes=2)
    assert two_nodes.groups("data_parallel") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert two_nodes.groups("tensor_parallel") == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_one_auto_size_beside_an_explicit_one_resolves_alone() -> None:
    # data_parallel_size="auto" is the node count (1), whatever tensor_parallel_size is.
    exp = lit(8, num_nodes=4, tensor_parallel_size=2)
    assert exp.groups("data_parallel") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    with pytest.raises(LayoutError) as refused:
        lit(8, tensor_parallel_size=2)
    assert refused.value.upstream == "RuntimeError"
    assert "`data_parallel_size=1` and `tensor_parallel_size=2`" in str(refused.value)


def test_roles_follow_the_sampler_and_the_fsdp2_recipe() -> None:
    exp = lit(8, data_parallel_size=4, tensor_parallel_size=2)
    assert dict(exp.roles) == {
        "data_parallel": "data_parallel",
        "gradient_reduce": "data_parallel",
        "tensor": "tensor_parallel",
    }
    assert exp.local_rank(5, "data_parallel") == 2  # the sampler's rank for global rank 5


@pytest.mark.parametrize("config", list(lightning.refused_configs(8)), ids=str)
def test_refused_configs_raise_runtime_error(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as refused:
        lit(8, **config)
    assert refused.value.upstream == "RuntimeError"


@pytest.mark.parametrize(
    "config",
    [
        {"data_parallel_size": 2.0, "tensor_parallel_size": 4},
        {"num_nodes": 3},
        {"num_nodes": 0},
        {"data_parallel_size": True, "tensor_parallel_size": 8},
    ],
    ids=str,
)
def test_values_outside_lightning_api_are_refused_without_an_upstream(
    config: dict[str, Any],
) -> None:
    with pytest.raises(LayoutError) as refused:
        lit(8, **config)
    assert refused.value.upstream is None


def test_unknown_key_names_the_strategy_parameter() -> None:
    with pytest.raises(LayoutError, match="did you mean 'tensor_parallel_size'"):
        lit(8, tensor_parallel=2)


def test_sweep_lists_each_split_and_each_auto_default() -> None:
    cases = meshsim.layouts(8, "lightning")
    assert len(cases) == 12
    shapes = {tuple(c.expect().layout.shape) for c in cases}  # type: ignore[union-attr]
    assert shapes == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert len(meshsim.layouts(8, "lightning", auto=False)) == 4


def test_a_million_ranks_answer_fast() -> None:
    exp = lit(2**20, num_nodes=2**10)
    assert exp.group_of(2**20 - 1, "data_parallel")[:2] == (1023, 2047)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 6, 8, 12, 16, 30]), st.data())
def test_groups_partition_the_world_and_cross_once(world: int, data: st.DataObject) -> None:
    dp = data.draw(st.sampled_from(divisors(world)))
    exp = lit(world, data_parallel_size=dp, tensor_parallel_size=world // dp)
    for kind in ("data_parallel", "tensor_parallel"):
        members = sorted(r for g in exp.groups(kind) for r in g)
        assert members == list(range(world))
    for rank in range(world):
        dp_group = exp.group_of(rank, "data_parallel")
        tp_group = exp.group_of(rank, "tensor_parallel")
        assert set(dp_group) & set(tp_group) == {rank}
