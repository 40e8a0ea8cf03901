"""megatron-core's own ``initialize_model_parallel`` and getters, on gloo, against the reference."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from meshsim import layouts
from meshsim.harness import run
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    require,
)

pytestmark = [require("megatron", "megatron.core"), pytest.mark.requires_framework("megatron")]

TP, PP, CP = "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"
EP, ETP = "expert_model_parallel_size", "expert_tensor_parallel_size"


def embedding_with_middle_stage(pp_ranks: list[int]) -> list[int]:
    """A custom ``get_embedding_ranks``: first, middle and last stage (encoder-decoder style)."""
    if len(pp_ranks) < 3:
        return list(pp_ranks)
    return [pp_ranks[0], pp_ranks[len(pp_ranks) // 2], pp_ranks[-1]]


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
    pytest.param(
        {CP: 4, "hierarchical_context_parallel_sizes": [2, 2]},
        marks=pytest.mark.skipif(
            importlib.util.find_spec("einops") is None,
            reason="megatron's hierarchical CP groups need einops (pip install einops)",
        ),
    ),
    {CP: 2, "hybrid_context_parallel": True},
    {PP: 4, "get_embedding_ranks": embedding_with_middle_stage},
    {PP: 2, TP: 2, "order": "tp-pp-dp"},
    {TP: 2, CP: 2, "order": "cp-tp-dp-pp"},
]
REFUSED: list[tuple[int, dict[str, Any]]] = [
    (4, {TP: 3}),  # RuntimeError: world not divisible
    (4, {"virtual_pipeline_model_parallel_size": 2}),  # RuntimeError: interleaving needs pp > 1
    (4, {TP: 2, EP: 4}),  # RuntimeError: etp x ep x pp does not divide the world
    (4, {"num_distributed_optimizer_instances": 3}),  # AssertionError
    (8, {TP: 2, PP: 2, CP: 2, "order": "tp-cp-pp-ep-dp"}),  # AssertionError: pp not last
    (4, {TP: 2, "order": "dp-pp"}),  # RuntimeError: tp missing from the order
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


ORDERS_8 = [case for case in layouts(8, "megatron", all_orders=True, expert=False)
            if case.config[TP] == 2 and case.config[PP] == 2]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", ORDERS_8, ids=case_id)
def test_every_order_matches_reference(case: Any) -> None:
    """Every order string megatron accepts with tp 2 and pp 2 on 8 ranks (cp 1 or 2)."""
    assert_matches("megatron", case.world_size, case.config)
