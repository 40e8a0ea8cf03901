"""verl 0.9.1's own engine mesh code and dispatch bookkeeping, on gloo, against the reference.

verl pins transformers<5.11, which the main environment's transformers does not satisfy, so
these tests run where verl is importable (e.g. ``.venvs/verl-0.9.1/bin/python -m pytest
tests/real/test_verl.py``) and are skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from meshsim.harness import run
from meshsim.model.conventions import verl
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
)

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("verl") is None,
        reason="verl is not importable here: verl 0.9.1 pins transformers<5.11, so it lives in "
        "its own virtual environment; run this file with that environment's python",
    ),
    pytest.mark.requires_framework("verl"),
]

WORLD_4: list[dict[str, Any]] = [
    {},
    {"fsdp_size": 2},
    {"fsdp_size": 1},  # verl#7493: FSDP1 reduces over one rank
    {"strategy": "fsdp2", "fsdp_size": 1},  # FSDP2's backward averages over all four
    {"ulysses_sequence_parallel_size": 2},
    {"strategy": "fsdp2", "fsdp_size": 2, "ulysses_sequence_parallel_size": 4},
    {"strategy": "torchtitan", "data_parallel_shard_size": 2, "context_parallel_size": 2},
    {"strategy": "torchtitan", "data_parallel_shard_size": 2, "tensor_parallel_size": 2},
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_verl_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("verl", 4, config)


@pytest.mark.parametrize("config", list(verl.refused_configs(4)), ids=case_id)
def test_refusals_match(config: dict[str, Any]) -> None:
    assert assert_refused_alike("verl", 4, config)


def _sharding_strategy(world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ddp", "fsdp"))
    return str(get_sharding_strategy(mesh))


def test_verl_picks_hybrid_shard_for_a_one_rank_shard_dim() -> None:
    """The root of verl#7493: HYBRID_SHARD, which FSDP1 then clamps to NO_SHARD."""
    assert set(run(_sharding_strategy, 2, backend="gloo", timeout=TIMEOUT, args=(2,))) == {
        "ShardingStrategy.HYBRID_SHARD"
    }


def test_build_leaves_the_environment_alone() -> None:
    assert environment_changes("verl", 4, {"ulysses_sequence_parallel_size": 2}) == []


@pytest.mark.parametrize(
    "config",
    [{"fsdp_size": 2, "ulysses_sequence_parallel_size": 2}, {"fsdp_size": 1}],
    ids=case_id,
)
def test_the_dataflow_recipe_passes_on_verls_own_engine(config: dict[str, Any]) -> None:
    from meshsim.dataflow.recipes import check_dataflow

    result = check_dataflow("verl", 4, "gloo", real=True, **config)
    assert result.passed, str(result)
