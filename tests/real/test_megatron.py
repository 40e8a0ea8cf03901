"""megatron-core's own ``initialize_model_parallel`` and getters, on gloo, against the reference."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from meshsim import layouts
from meshsim.harness import run
from meshsim.model.conventions.megatron import refused_configs
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    require,
)

pytestmark = [require("megatron", "megatron.core"), pytest.mark.requires_framework("megatron")]

#: megatron's hierarchical CP groups and HyperCommGrid enumerate ranks with einops.
needs_einops = pytest.mark.skipif(
    importlib.util.find_spec("einops") is None,
    reason="megatron's hierarchical CP groups and HyperCommGrid need einops (pip install einops)",
)

TP, PP, CP = "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"
EP, ETP = "expert_model_parallel_size", "expert_tensor_parallel_size"


def embedding_with_middle_stage(pp_ranks: list[int]) -> list[int]:
    """A custom ``get_embedding_ranks``: first, middle and last stage (encoder-decoder style)."""
    if len(pp_ranks) < 3:
        return list(pp_ranks)
    return [pp_ranks[0], pp_ranks[len(pp_ranks) // 2], pp_ranks[-1]]


NO_GLOO_WITH_AG = {
    "num_distributed_optimizer_instances": 2,
    "create_gloo_process_groups": False,
    "create_all_gather_group": True,
}
GRID_TP_CP_DP = {
    "shape": [2, 2, 2],
    "dim_names": ["tp", "cp", "dp"],
    "pgs": ["tp", "cp", ["cp", "dp"], ["dp", "tp"], ["tp", "cp", "dp"]],
}
GRID_UPPER_HALF = {
    "shape": [2, 2],
    "dim_names": ["tp", "dp"],
    "rank_offset": 4,
    "pgs": ["dp", ["dp", "tp"]],
}

WORLD_4: list[dict[str, Any]] = [
    {},
    {TP: 2},
    {PP: 2},
    {CP: 2},
    {TP: 2, PP: 2},
    {PP: 4},
    {EP: 2, ETP: 1},
    {EP: 4, ETP: 1},
    {TP: 2, EP: 2, ETP: 1},
    {TP: 2, "order": "tp-pp-dp"},
    {TP: 2, PP: 2, "order": "tp-cp-ep-pp-dp"},
    {PP: 2, "virtual_pipeline_model_parallel_size": 2},
]
WORLD_8: list[Any] = [
    {TP: 2, CP: 2, PP: 2},
    {TP: 2, PP: 2, EP: 2},
    {CP: 2, EP: 2, ETP: 1},
    {TP: 2, "num_distributed_optimizer_instances": 2},
    {TP: 2, EP: 2, "num_distributed_optimizer_instances": 2},
    pytest.param({CP: 4, "hierarchical_context_parallel_sizes": [2, 2]}, marks=needs_einops),
    {CP: 2, "hybrid_context_parallel": True},
    {PP: 4, "get_embedding_ranks": embedding_with_middle_stage},
    {PP: 2, TP: 2, "order": "tp-pp-dp"},
    {TP: 2, CP: 2, "order": "cp-tp-dp-pp"},
    # gloo twins not made (their getters assert), a separate all-gather dp-cp group made
    {TP: 2, EP: 2, **NO_GLOO_WITH_AG},
    pytest.param({TP: 2, CP: 2, "hyper_comm_grid": GRID_TP_CP_DP}, marks=needs_einops),
    pytest.param({"hyper_comm_grid": GRID_UPPER_HALF}, marks=needs_einops),
]
REFUSED: list[tuple[int, dict[str, Any]]] = [
    (4, {TP: 3}),  # RuntimeError: world not divisible
    (4, {"virtual_pipeline_model_parallel_size": 2}),  # RuntimeError: interleaving needs pp > 1
    (4, {TP: 2, EP: 4}),  # RuntimeError: etp x ep x pp does not divide the world
    (4, {"num_distributed_optimizer_instances": 3}),  # AssertionError
    (8, {TP: 2, PP: 2, CP: 2, "order": "tp-cp-pp-ep-dp"}),  # AssertionError: pp not last
    (4, {TP: 2, "order": "dp-pp"}),  # RuntimeError: tp missing from the order
]
AB = {"shape": [2, 4], "dim_names": ["a", "b"]}
GRID_REFUSED: list[dict[str, Any]] = [
    {**AB, "dim_names": ["a"]},  # ValueError: len(shape) != len(dim_names)
    {**AB, "rank_offset": 1},  # RuntimeError: grid larger than the world past the offset
    {**AB, "pgs": [["a", "c"]]},  # ValueError: a list naming an unknown dim
    {**AB, "pgs": [[]]},  # TypeError: an empty list
    {**AB, "pgs": [["b", "a"], ["a", "b"]]},  # KeyError: the same key twice
    {**AB, "pgs": ["c"]},  # EinopsError: a string naming no dim
    {**AB, "dim_names": ["a", "b_"], "pgs": ["a"]},  # EinopsError: not an einops axis name
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("megatron", 4, config)


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("megatron", 8, config)


@pytest.mark.parametrize(("world", "config"), REFUSED, ids=case_id)
def test_refusals_match_reference(world: int, config: dict[str, Any]) -> None:
    assert_refused_alike("megatron", world, config)


@needs_einops
@pytest.mark.parametrize("spec", GRID_REFUSED, ids=case_id)
def test_hyper_comm_grid_refusals_match_reference(spec: dict[str, Any]) -> None:
    """Each refusal comes from megatron's own HyperCommGrid, after initialize_model_parallel."""
    assert_refused_alike("megatron", 8, {"hyper_comm_grid": spec})


@needs_einops
def test_hyper_comm_grid_example() -> None:
    """Worked example: grid [2, 2, 2] over a, b, c on 8 ranks (rank = a + 2b + 4c). Each list
    is stored under its dims slowest first."""
    spec = {"shape": [2, 2, 2], "dim_names": ["a", "b", "c"], "pgs": [["a", "b"], ["c", "a"], "b"]}
    rank0 = assert_matches("megatron", 8, {"hyper_comm_grid": spec})[0]
    grid = {k: v.members for k, v in rank0.groups.items() if k.startswith("hyper_comm_grid")}
    assert grid == {
        "hyper_comm_grid[b-a]": (0, 1, 2, 3),
        "hyper_comm_grid[c-a]": (0, 1, 4, 5),
        "hyper_comm_grid[b]": (0, 2),
    }


def test_gloo_twins_are_made_by_default() -> None:
    """megatron's default ``create_gloo_process_groups=True``: each twin is its own group over
    the ranks of the group it twins (not the same object), with the all-gather group unmade."""
    rank3 = assert_matches("megatron", 4, {TP: 2})[3]
    for twin, base in (("dp:gloo", "dp"), ("dp-cp:gloo", "dp-cp"), ("expert:dp:gloo", "expert:dp")):
        assert rank3.groups[twin].members == rank3.groups[base].members == (1, 3)
    assert "dp-cp:ag" in rank3.absent


def test_tp_dp_pp_example() -> None:
    """Worked example: world 8, tp 2, pp 2 (default order) on megatron itself."""
    rank0 = assert_matches("megatron", 8, {TP: 2, PP: 2})[0]
    groups = {name: rank0.groups[name].members for name in ("tp", "dp", "pp", "embedding")}
    assert groups == {"tp": (0, 1), "dp": (0, 2), "pp": (0, 4), "embedding": (0, 4)}


def _initialize_twice() -> int:
    from meshsim.builders.real import megatron

    megatron.build(4, {TP: 2})
    return len(megatron.build(4, {PP: 2}).groups)


def test_parallel_state_is_reset_between_builds() -> None:
    """Two builds in one worker: ``destroy_model_parallel`` around each keeps megatron's
    "already initialized" assertions quiet."""
    assert run(_initialize_twice, 4, backend="gloo", timeout=TIMEOUT)[0] > 10


def test_build_leaves_environment_unchanged() -> None:
    """Keeps harness workers warm: a worker whose environment changed is replaced."""
    assert environment_changes("megatron", 4, {TP: 2}) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(4, "megatron") + layouts(8, "megatron"), ids=case_id)
def test_every_config_matches_reference(case: Any) -> None:
    assert_matches("megatron", case.world_size, case.config)


@pytest.mark.slow
@needs_einops
@pytest.mark.parametrize("config", list(refused_configs(8)), ids=case_id)
def test_every_listed_refusal_matches_reference(config: dict[str, Any]) -> None:
    assert_refused_alike("megatron", 8, config)


ORDERS_8 = [case for case in layouts(8, "megatron", all_orders=True, expert=False)
            if case.config[TP] == 2 and case.config[PP] == 2]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", ORDERS_8, ids=case_id)
def test_every_order_matches_reference(case: Any) -> None:
    """Every order string megatron accepts with tp 2 and pp 2 on 8 ranks (cp 1 or 2)."""
    assert_matches("megatron", case.world_size, case.config)
