"""Lightning 2.6.6's own ModelParallelStrategy.setup_environment, on gloo, against the reference."""

from __future__ import annotations

from typing import Any

import pytest

from meshsim.harness import run
from meshsim.model.conventions import lightning
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    require,
)

pytestmark = [require("lightning", "lightning"), pytest.mark.requires_framework("lightning")]

WORLD_4: list[dict[str, Any]] = [
    {},  # "auto": one node of 4 tensor-parallel processes
    {"num_nodes": 2},
    {"data_parallel_size": 4, "tensor_parallel_size": 1},
    {"num_nodes": 2, "tensor_parallel_size": 2},  # data_parallel_size="auto" beside it
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_strategy_mesh_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("lightning", 4, config)


@pytest.mark.parametrize("config", list(lightning.refused_configs(4)), ids=case_id)
def test_refusals_match(config: dict[str, Any]) -> None:
    message = assert_refused_alike("lightning", 4, config)
    assert message


def _both_meshes(world: int, config: dict[str, Any]) -> tuple[list[list[int]], list[list[int]]]:
    from meshsim.builders.real import lightning as adapter

    trainer = adapter.set_up("pytorch", world, config).device_mesh.mesh.tolist()
    fabric = adapter.set_up("fabric", world, config).device_mesh.mesh.tolist()
    return trainer, fabric


def test_fabric_and_trainer_strategies_build_the_same_mesh() -> None:
    per_rank = run(_both_meshes, 4, backend="gloo", timeout=TIMEOUT, args=(4, {"num_nodes": 2}))
    for trainer, fabric in per_rank:
        assert trainer == fabric == [[0, 1], [2, 3]]


def test_build_leaves_the_environment_alone() -> None:
    assert environment_changes("lightning", 4, {"num_nodes": 2}) == []
