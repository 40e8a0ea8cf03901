"""Real DeepSpeed AutoEP + AutoTP folding adapter: the engine's own group creation, on gloo.

``build(world_size, config)`` replays ``DeepSpeedEngine.__init__`` (0.19.8) up to the point where
it hands the folded MoE layers their groups, calling DeepSpeed's functions in its order:

1. ``_configure_expert_parallel``: ``auto_ep_folding.build_folding_spec`` and
   ``validate_folding_global`` (with a ``PipelineParallelGrid`` as the mpu when ``pp_size > 1``,
   as a pipeline run has; its tensor size is 1), then
   ``groups._create_expert_and_data_parallel(ep, mp_size=max(tp, 1), pp_size=pp, mp_mode=...,
   folding_spec=spec if tp > 1 else None)``;
2. ``tp_size > 1``: ``_configure_tensor_parallel_states`` 's ``groups._init_tp_mesh_device(tp)``
   and ``groups.mpu = groups``; otherwise the grid (or None) stays the mpu;
3. the groups the engine puts in ``FoldingGroupHandles``, observed by the kind names of
   ``meshsim.model.conventions.deepspeed_autoep``: ``tp`` =
   ``groups.get_tensor_model_parallel_group()`` (absent when ``tp_size == 1``: none exists),
   ``dense_dp`` = ``groups._get_data_parallel_group()``, ``ep`` / ``edp`` =
   ``groups._get_expert_parallel_group`` / ``_get_expert_data_parallel_group('ep_size_<ep>')``.

DeepSpeed keeps every group in module globals of ``deepspeed.utils.groups`` (and returns early
when one is set), so ``groups._release_process_group_references()``, DeepSpeed's own WORLD
teardown hook, empties them before and after each build; ``deepspeed.comm`` is set up without
``init_distributed`` (:func:`meshsim.builders.real._shims.deepspeed_comm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation
from meshsim.model.conventions import deepspeed_autoep

_MODULES = (
    "deepspeed.module_inject.auto_ep_folding",
    "deepspeed.utils.groups",
    "deepspeed.runtime.pipe.topology",
    "deepspeed.utils.bwc",
)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """DeepSpeed's folding groups for ``config``, observed on this rank.

    Example (world 8): ``{"tp_size": 2, "ep_size": 4}`` gives rank 0 tp ``(0, 1)``, dense_dp
    ``(0, 2, 4, 6)``, ep ``(0, 1, 2, 3)`` and edp ``(0, 4)``.
    """
    with folding_groups(world_size, config) as (_, entries):
        return collect(entries)


@contextlib.contextmanager
def folding_groups(
    world_size: int, config: Mapping[str, Any]
) -> Iterator[tuple[Any, dict[str, Entry]]]:
    """DeepSpeed's ``ParallelFoldingSpec`` and live groups by kind, usable inside the block.

    For programs that train over the groups (the data-flow tests): the groups stay DeepSpeed's
    module state only while the block runs.
    """
    check_keys("deepspeed-autoep", config)
    folding, _, topology, bwc = _shims.load(*_MODULES)
    sizes = deepspeed_autoep.engine_sizes(config)  # the engine's max(autotp_size, 1)
    with framework_refusals():
        spec = folding.build_folding_spec(
            world_size=world_size, **sizes, mp_mode=config.get("mp_mode", "tp")
        )
    with _shims.unchanged_environ(), _shims.deepspeed_comm(), _released_groups() as groups:
        with framework_refusals():
            entries = _engine_groups(folding, groups, topology, bwc, spec)
        yield spec, entries


def _engine_groups(
    folding: Any, groups: Any, topology: Any, bwc: Any, spec: Any
) -> dict[str, Entry]:
    """The engine's calls, in its order; the four groups of ``FoldingGroupHandles``."""
    mpu = None
    if spec.pp_size > 1:
        mpu = topology.PipelineParallelGrid(
            topology=topology.PipeDataParallelTopology(num_pp=spec.pp_size, num_dp=spec.stage_size)
        )
    folding.validate_folding_global(spec, mpu=mpu)
    tp, ep = spec.tp_size, spec.ep_size
    groups._create_expert_and_data_parallel(
        expert_parallel_size_=ep,
        mp_size=max(tp, 1),
        pp_size=bwc.bwc_pipeline_parallel_world_size(mpu),
        mp_mode="tp" if tp > 1 else "sp",
        use_data_before_expert_parallel_=False,
        folding_spec=spec if tp > 1 else None,
    )
    if tp > 1:
        groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
        mpu = groups
    groups.mpu = mpu
    name = f"ep_size_{ep}"
    return {
        "tp": groups.get_tensor_model_parallel_group()
        if tp > 1
        else RuntimeError("no AutoTP group at autotp_size 1"),
        "dense_dp": groups._get_data_parallel_group(),
        "ep": groups._get_expert_parallel_group(name),
        "edp": groups._get_expert_data_parallel_group(name),
    }


@contextlib.contextmanager
def _released_groups() -> Iterator[Any]:
    """``deepspeed.utils.groups`` with every cached group and ``mpu`` dropped, before and after."""
    (groups,) = _shims.load("deepspeed.utils.groups")
    groups._release_process_group_references(None)
    try:
        yield groups
    finally:
        groups._release_process_group_references(None)
