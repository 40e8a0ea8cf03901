"""DeepSpeed's own AutoEP + AutoTP folding group creation (engine order), on gloo."""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import expect
from meshsim.dataflow import assert_data_parallel, grad_check
from meshsim.errors import DataflowMismatch
from meshsim.harness import run
from meshsim.model.conventions.deepspeed_autoep import configs, refused_configs
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    require,
)

pytestmark = [require("deepspeed", "deepspeed"), pytest.mark.requires_framework("deepspeed")]

FW = "deepspeed-autoep"
WORLD_8: list[dict[str, Any]] = [
    {"tp_size": 2, "ep_size": 4},  # folded path: AutoTP mesh + folding tables
    {"tp_size": 4, "ep_size": 2},  # cross-lane EP
    {"tp_size": 2, "ep_size": 8},
    {"pp_size": 2, "ep_size": 2},  # legacy path, a PipelineParallelGrid as the mpu
    {"ep_size": 4},  # legacy path, the world clone as dense data parallel
]
REFUSED_8: list[dict[str, Any]] = [
    {"pp_size": 3},  # build_folding_spec
    {"tp_size": 2, "ep_size": 1},  # validate_folding_global
    {"pp_size": 2, "tp_size": 2, "ep_size": 2},  # validate_folding_global, after the grid
    {"ep_size": 2, "etp_size": 2},
]


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches(FW, 8, config)


@pytest.mark.parametrize("config", REFUSED_8, ids=case_id)
def test_refusals_match(config: dict[str, Any]) -> None:
    message = assert_refused_alike(FW, 8, config)
    assert message.startswith("ValueError: ")


def _cached_rank_lists(world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """On a rank: build, then what DeepSpeed's module globals hold afterwards (must be empty)."""
    from deepspeed.utils import groups

    from meshsim.builders.real.deepspeed_autoep import build

    build(world_size, config)
    return {
        "ep": dict(groups._EXPERT_PARALLEL_GROUP_RANKS),
        "tp": groups._TENSOR_MODEL_PARALLEL_GROUP,
        "world": groups._WORLD_GROUP,
        "mpu": groups.mpu,
    }


def test_deepspeed_group_state_is_released_between_builds() -> None:
    """``_create_expert_and_data_parallel`` returns early when ``ep_size_<n>`` is cached, and
    ``_clone_world_group`` hands back a cached clone: a warm worker must start from nothing,
    so a second build with other sizes still matches (and leaves nothing behind)."""
    for config in ({"tp_size": 2, "ep_size": 2}, {"tp_size": 4, "ep_size": 2}):
        left = run(_cached_rank_lists, 8, backend="gloo", timeout=TIMEOUT, args=(8, config))
        assert all(v == {"ep": {}, "tp": None, "world": None, "mpu": None} for v in left)
        assert_matches(FW, 8, config)


def test_build_leaves_environment_alone() -> None:
    assert environment_changes(FW, 4, {"tp_size": 2, "ep_size": 2}) == []


def _train(world_size: int, config: dict[str, Any], wiring: str) -> tuple[Any, Any]:
    """On a rank: load batches and reduce a dense layer's gradient over DeepSpeed's live groups.

    The gradient takes the folded path a dense parameter takes in the engine: DeepSpeed's own
    ``reduce_autoep_folding_gradient`` over the TP group (AVERAGE), then the data-parallel
    all-reduce. ``wiring`` names the group the sampler and the reduction use instead of
    ``dense_dp`` (``"sampler_over_ep"``, ``"reduce_over_ep"``), mistakes the checks must catch.
    """
    import torch
    import torch.distributed as dist
    from deepspeed.module_inject import auto_ep_folding
    from torch.utils.data import DistributedSampler

    from meshsim.builders.real.deepspeed_autoep import folding_groups
    from meshsim.dataflow import loss_scale, record_batches
    from meshsim.dataflow.grad_check import fingerprints

    with folding_groups(world_size, config) as (spec, groups):
        loader = groups["ep" if wiring == "sampler_over_ep" else "dense_dp"]
        sampler = DistributedSampler(
            range(32),
            num_replicas=dist.get_world_size(loader),
            rank=dist.get_rank(loader),
            shuffle=False,
        )
        ids = list(sampler)[:4]
        batches = [ids[:2], ids[2:]]
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        inputs = torch.tensor([[float(i + 1)] * 4 for i in ids])
        (model(inputs).sum() * loss_scale()).backward()
        grad = model.weight.grad
        strategy = auto_ep_folding.reduce_autoep_folding_gradient(
            spec, model.weight, grad, tp_group=groups["tp"]
        )
        assert strategy == "average"
        reducer = groups["ep" if wiring == "reduce_over_ep" else "dense_dp"]
        dist.all_reduce(grad, group=reducer)
        grad /= dist.get_world_size(reducer)
        return record_batches(batches), fingerprints(model)


@pytest.mark.parametrize("wiring", ["correct", "sampler_over_ep", "reduce_over_ep"])
def test_dataflow_over_live_folding_groups(wiring: str) -> None:
    """tp 4, ep 2 (world 8): TP peers 0..3 load the same samples, the dense-DP pairs (0, 4), ...
    load different ones and agree on the dense gradient; the EP pairs are model groups."""
    config = {"tp_size": 4, "ep_size": 2}
    expected = expect(FW, 8, **config)
    per_rank = run(_train, 8, backend="gloo", timeout=TIMEOUT, args=(8, config, wiring))
    records = [record for record, _ in per_rank]
    prints = {record.rank: theirs for record, theirs in per_rank}
    grad_problems = grad_check.find_problems(prints, expected)
    assert bool(grad_problems) == (wiring == "reduce_over_ep"), grad_problems
    if wiring != "sampler_over_ep":
        assert_data_parallel(records, expected)
        return
    with pytest.raises(DataflowMismatch, match="TP peers"):
        assert_data_parallel(records, expected)


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 16])
def test_every_config_and_refusal(world: int) -> None:
    for config in configs(world):
        assert_matches(FW, world, config)
    for config in refused_configs(world):
        assert_refused_alike(FW, world, config)
