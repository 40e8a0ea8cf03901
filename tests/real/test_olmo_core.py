"""ai2-olmo-core's own ``build_world_mesh`` and getters, on gloo, against meshsim's reference."""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import expect, layouts, refused_configs
from meshsim.errors import LayoutError
from meshsim.harness import run
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    real_outcomes,
    require,
)

pytestmark = [require("olmo-core", "olmo_core"), pytest.mark.requires_framework("olmo-core")]

WORLD_4: list[dict[str, Any]] = [
    {},
    {"dp": "ddp"},
    {"dp": "fsdp", "tp": 2},
    {"dp": "fsdp", "cp": 2},
    {"dp": "fsdp", "pp": 2},
    {"dp": "ddp", "pp": 1, "cp": 1, "tp": 1},  # present size-1 configs still make dims
    {"dp": "hsdp"},  # NUM_NODES=1: one replica of 4
    {"dp": "hsdp", "num_nodes": 2},
    {"dp": "hsdp", "num_replicas": 2},
    {"dp": "hsdp", "shard_degree": 2, "ep": 2},
    {"dp": "hsdp", "num_replicas": 2, "ep": -1},
    {"dp": "hsdp", "num_replicas": 2, "cp": 2},  # get_dp_shard_mesh raises (dp_cp fold)
    {"expert_mesh_ep": 2},
    {"expert_mesh_ep": -1},
]
WORLD_8: list[dict[str, Any]] = [
    {"dp": "hsdp", "num_replicas": 2, "cp": 2},
    {"dp": "hsdp", "num_replicas": 2, "shard_degree": 2, "cp": 2},
    {"dp": "hsdp", "num_replicas": 2, "ep": 2, "cp": 2},
    {"dp": "fsdp", "pp": 2, "cp": 2, "tp": 2},
    {"dp": "hsdp", "pp": 2, "num_replicas": 2, "tp": 2},
    {"dp": "fsdp", "tp": 2, "expert_mesh_ep": 4},
]
REFUSED_4: list[dict[str, Any]] = [
    {"tp": 2},  # no dp config
    {"dp": "fsdp", "tp": 3},
    {"dp": "fsdp", "pp": 2, "cp": 4},  # cp must divide what pp left
    {"dp": "fsdp", "ep": 2},  # EP needs HSDP
    {"dp": "hsdp", "tp": 2, "ep": 2},  # EP and TP are exclusive
    {"dp": "hsdp", "num_replicas": 2, "ep": 4},  # EP must equal the shard degree
    {"dp": "hsdp", "num_replicas": 3},
    {"dp": "hsdp", "num_replicas": 4, "shard_degree": 4},  # 16 > 4: torch refuses
    {"dp": "hsdp", "num_nodes": 8},  # shard degree 4 // 8 = 0: ZeroDivisionError in torch
    {"dp": "hsdp", "num_replicas": 1, "shard_degree": 1, "ep": 2},  # ep check before the split
    {"expert_mesh_ep": 0},  # ZeroDivisionError in OLMo
    {"expert_mesh_ep": 3},
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("olmo-core", 4, config)


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("olmo-core", 8, config)


@pytest.mark.parametrize("config", REFUSED_4, ids=case_id)
def test_refusals_match_reference(config: dict[str, Any]) -> None:
    assert_refused_alike("olmo-core", 4, config)


@pytest.mark.parametrize("case", refused_configs(8, "olmo-core"), ids=str)
def test_the_conventions_refusals_are_olmo_cores(case: Any) -> None:
    assert_refused_alike("olmo-core", 8, case.config)


@pytest.mark.parametrize(
    ("config", "inside"),
    [
        ({"dp": "hsdp", "num_replicas": 2, "shard_degree": 2}, 4),
        ({"dp": "hsdp", "num_nodes": 3}, 6),
        ({"dp": "hsdp", "num_nodes": 3, "ep": -1}, 6),
        ({"dp": "hsdp", "num_nodes": 3, "cp": 2}, 6),  # RuntimeError: the DP mesh is a slice
        ({"dp": "hsdp", "num_nodes": 3, "cp": 1}, 6),  # IndexError: a size-1 cp changes nothing
        ({"dp": "hsdp", "num_nodes": 7, "cp": 1}, 7),
    ],
    ids=case_id,
)
def test_hsdp_split_smaller_than_world_fails_outside_the_mesh(
    config: dict[str, Any], inside: int
) -> None:
    """OLMo 3.0.0 does not check num_replicas x shard_degree: on torch 2.13 it builds the world
    mesh on the first ranks, and the ranks outside it fail in ``get_dp_process_group`` with the
    exception the reference's refusal names (IndexError when the DP mesh spans the whole world
    mesh, RuntimeError when a pp/cp/tp dim of size > 1 makes it a slice); the reference's message
    names the split."""
    with pytest.raises(LayoutError) as reference:
        expect("olmo-core", 8, **config)
    assert f"on ranks 0-{inside - 1} of 8 only" in str(reference.value)
    outcomes = real_outcomes("olmo-core", 8, config, diverging=True)
    assert [o[0] for o in outcomes] == ["built"] * inside + ["refused"] * (8 - inside)
    assert {o[2] for o in outcomes[inside:]} == {reference.value.upstream}


def _build_twice(world: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from meshsim.builders.real import olmo_core

    first = olmo_core.build(world, {"dp": "fsdp", "tp": 2})
    second = olmo_core.build(world, {"dp": "hsdp", "num_replicas": 2})
    return tuple(first.groups), tuple(second.groups)


def test_world_mesh_global_is_reset_between_builds() -> None:
    """``build_world_mesh`` twice in one process works: the ``_WORLD_MESH`` shim resets it."""
    first, second = run(_build_twice, 4, backend="gloo", timeout=TIMEOUT, args=(4,))[0]
    assert "tp" in first and "dp_replicate" in second


def test_build_leaves_environment_unchanged() -> None:
    """Keeps harness workers warm: a worker whose environment changed is replaced."""
    assert environment_changes("olmo-core", 4, {"dp": "hsdp", "num_replicas": 2, "cp": 1}) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(4, "olmo-core") + layouts(8, "olmo-core"), ids=case_id)
def test_every_config_matches_reference(case: Any) -> None:
    assert_matches("olmo-core", case.world_size, case.config)


def _expert_layouts(world: int, degrees: list[int]) -> list[Any]:
    from meshsim.builders.real import olmo_core

    return [olmo_core.expert_mesh(world, {"expert_mesh_ep": d}) for d in degrees]


def _assert_expert_meshes(world: int, degrees: list[int]) -> None:
    per_rank = run(_expert_layouts, world, backend="gloo", timeout=TIMEOUT, args=(world, degrees))
    expected = [expect("olmo-core", world, expert_mesh_ep=d).meshes["expert"] for d in degrees]
    assert all(layouts_seen == expected for layouts_seen in per_rank), (per_rank[0], expected)


def test_expert_mesh_layout_matches_reference() -> None:
    """OLMo's own ``build_expert_parallel_mesh``: dim names and rank array on every rank equal
    ``Expected.meshes["expert"]`` (a ``meshsim.Layout``)."""
    _assert_expert_meshes(4, [1, 2, 4, -1])


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 16])
def test_expert_mesh_layout_matches_reference_every_degree(world: int) -> None:
    _assert_expert_meshes(world, [*(d for d in range(1, world + 1) if world % d == 0), -1])


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(16, "olmo-core"), ids=case_id)
def test_every_config_matches_reference_world_16(case: Any) -> None:
    assert_matches("olmo-core", 16, case.config)
