"""transformers' own ``initialize_distributed_mesh`` and Trainer hand-off, on gloo, vs meshsim."""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import expect, layouts
from meshsim.errors import LayoutError
from meshsim.harness import run
from meshsim.model.conventions._transformers_configs import refused_configs
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    case_id,
    environment_changes,
    require,
)

pytestmark = [
    require("transformers", "transformers"),
    require("transformers", "accelerate"),
    pytest.mark.requires_framework("transformers"),
]

WORLD_4: list[dict[str, Any]] = [
    {},  # every size 1: no mesh at all
    {"fsdp_size": 4},
    {"tp_size": 4},
    {"fsdp_size": 2, "tp_size": 2, "ep_size": 4},
    {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},  # HSDP: 2-D fsdp meshes
    {"dp_replicate_size": 2, "tp_size": 2},  # the Trainer folds the replicas into dp_shard
    {"pp_size": 2, "tp_size": 2},  # the Trainer's accelerate mesh is refused
    {"tp_plan": "auto", "fsdp_size": 2},  # tp derived from WORLD_SIZE
    {"tp_size": 4, "enable_expert_parallel": True},
]
WORLD_8: list[dict[str, Any]] = [
    {"dp_replicate_size": 2, "fsdp_size": 2, "tp_size": 2, "ep_size": 4},
    {"fsdp_size": 4, "tp_size": 2, "ep_size": 8},
    {"pp_size": 4, "tp_size": 2, "ep_size": 2},
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4(config: dict[str, Any]) -> None:
    assert_matches("transformers", 4, config)


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8(config: dict[str, Any]) -> None:
    assert_matches("transformers", 8, config)


def _refusals_on_rank(configs: list[dict[str, Any]]) -> list[str | None]:
    """On a rank: the exception type transformers raises for each config (None: built). Every
    refusal comes before any group is made, so one harness run tries them all."""
    from tests.real._helpers import adapter

    raised: list[str | None] = []
    for config in configs:
        try:
            adapter("transformers").build(4, config)
        except Exception as error:
            raised.append(getattr(error, "upstream", None) or type(error).__name__)
        else:
            raised.append(None)
    return raised


def test_refused_alike_world_4() -> None:
    configs = list(refused_configs(4))
    wanted = []
    for config in configs:
        with pytest.raises(LayoutError) as reference:
            expect("transformers", 4, **config)
        wanted.append(reference.value.upstream)
    assert set(wanted) == {"ValueError", "RuntimeError"}
    for raised in run(_refusals_on_rank, 4, backend="gloo", timeout=TIMEOUT, args=(configs,)):
        assert raised == wanted


def test_build_leaves_the_environment_alone() -> None:
    assert environment_changes("transformers", 4, {"fsdp_size": 2, "tp_size": 2}) == []


def _meshes_collide() -> tuple[bool, bool, bool, bool]:
    """On a rank: do the dense and expert ``pp`` sub-meshes, and the model's and the Trainer's
    ``tp``, compare equal while holding different process groups?"""
    from accelerate import ParallelismConfig
    from transformers.distributed import DistributedConfig
    from transformers.distributed.mixin import DistributedMixin

    config = DistributedConfig(fsdp_size=2, tp_size=2)
    _, _, manager = DistributedMixin.prepare_distribute_model(config)
    dense_pp, expert_pp = manager.get_mesh("pp"), manager._expert_mesh["pp"]
    trainer = ParallelismConfig(tp_size=2, dp_shard_size=2).build_device_mesh("cpu")
    model_tp, trainer_tp = manager.get_mesh("tp"), trainer["tp"]
    return (
        dense_pp == expert_pp and hash(dense_pp) == hash(expert_pp),
        dense_pp.get_group() is expert_pp.get_group(),
        model_tp == trainer_tp and hash(model_tp) == hash(trainer_tp),
        model_tp.get_group() is trainer_tp.get_group(),
    )


def test_meshes_over_the_same_ranks_compare_equal_on_different_communicators() -> None:
    # What the multi-mesh check must catch: torch's DeviceMesh equality ignores the process
    # groups, so two meshes built over the same ranks pass for one.
    for equal_pp, shared_pp, equal_tp, shared_tp in run(
        _meshes_collide, 4, backend="gloo", timeout=TIMEOUT
    ):
        assert equal_pp and not shared_pp
        assert equal_tp and not shared_tp


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_every_listed_layout(world: int) -> None:
    for case in layouts(world, "transformers"):
        assert_matches("transformers", world, case.config)
