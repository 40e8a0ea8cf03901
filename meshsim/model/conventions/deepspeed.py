"""DeepSpeed: ``PipelineParallelGrid`` over a ``ProcessTopology``, plus the MoE expert groups.

The topology is ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes pipe, data,
model), ``PipeDataParallelTopology(num_pp, num_dp)`` when ``num_mp`` is not given, a raw
``ProcessTopology(axes, dims)``, or with no config the grid's prime-factor default. Kinds:

* one per topology axis (``get_axis_comm_lists``): ``pipe``, ``data``, ``model`` (the grid's
  slice groups; singletons when the topology has no model axis);
* ``model_parallel``: DeepSpeed's model-parallel group, every pipe × model rank of one replica;
* ``p2p``: DeepSpeed's list of ``[rank, next stage]`` pairs, one per rank, wrapping around; row
  ``r`` is rank ``r``'s own pair, in ``grid.p2p_groups`` order;
* ``embedding``: tied-layer groups of ``PipelineModule`` for a layer tied between the first and
  last stage (GPT's embedding/head); DeepSpeed builds none when there is one stage, and none can
  be built (the ranks deadlock) when the topology has an axis of size > 1 besides pipe, data
  and model;
* ``expert`` / ``expert_data`` when ``ep`` is given: the groups a ``deepspeed.moe.layer.MoE``
  creates, with the grid as ``groups.mpu`` (as the engine sets it). With
  ``enable_expert_tensor_parallelism=False`` (DeepSpeed's default), or without a grid (no
  ``mpu``), ``_create_expert_and_data_parallel(ep)``, which ignores tensor parallelism; with
  ``True`` and a grid, ``_create_expert_data_and_model_parallel`` (``_get_expert_parallel_ranks``);
  with ``mp_size`` the engine's direct ``_create_expert_and_data_parallel(ep, mp_size, mp_mode)``.

``grid`` tells a bare ``ProcessTopology`` (``False``: only ``get_axis_comm_lists`` groups) from a
``PipelineParallelGrid`` built on it (``True``: the grid reads every rank's ``pipe`` and ``data``
coordinate, so a topology without either axis raises ``AttributeError``); unset, a topology is a
grid exactly when it has both axes. Helpers of ``deepspeed.utils.groups`` outside the grid, each
opt-in: ``autotp_size`` (AutoTP's ``_init_tp_mesh_device``: kinds ``groups.get_*_group``) and
``model_parallel_size`` (``_create_model_parallel``: kinds ``_create_model_parallel.data`` /
``.model``). ``partition_parts`` gives ``PipelineModule.parts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown
from meshsim.model.conventions._deepspeed_configs import configs, refused_configs
from meshsim.model.conventions._deepspeed_groups import (
    MP_MODES,
    autotp_ranks,
    create_model_parallel_ranks,
    mp_expert_and_data_parallel_ranks,
    partition_parts,
)
from meshsim.model.conventions._deepspeed_topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    default_topology,
    expert_and_data_parallel_ranks,
    expert_parallel_ranks,
    prime_factors,
)
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups

__all__ = [
    "MP_MODES",
    "PARAMETERS",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "autotp_ranks",
    "configs",
    "create_model_parallel_ranks",
    "default_topology",
    "expect",
    "expert_and_data_parallel_ranks",
    "expert_parallel_ranks",
    "mp_expert_and_data_parallel_ranks",
    "partition_parts",
    "prime_factors",
    "refused_configs",
    "topology",
]

PARAMETERS: Final[Mapping[str, str]] = {
    "num_pp": "pipeline stages (default 1 when num_mp or num_dp is given)",
    "num_mp": "model (tensor) parallel degree; None: PipeDataParallelTopology (no model axis)",
    "num_dp": "data-parallel degree (default: world / (num_pp × num_mp))",
    "axes": "a raw ProcessTopology's axis names, outermost first (with dims)",
    "dims": "a raw ProcessTopology's axis sizes (with axes)",
    "ep": "MoE expert-parallel size (None: no MoE groups)",
    "use_data_before_expert_parallel_": "MoE D + E layout instead of E + D (default False)",
    "enable_expert_tensor_parallelism": "MoE(enable_expert_tensor_parallelism=...): True takes "
    "the expert-tensor-parallel groups of _get_expert_parallel_ranks (needs the grid as mpu); "
    "False (default, as DeepSpeed) _create_expert_and_data_parallel, which ignores tp",
    "mp_size": "MoE groups from _create_expert_and_data_parallel(ep, mp_size=...) called directly "
    "(the engine's AutoEP path); > 1 takes its TP-strided ('tp') or consecutive ('sp') order",
    "mp_mode": "with mp_size: 'tp' (default) or 'sp'",
    "grid": "True: build PipelineParallelGrid on the topology (needs pipe and data axes); False: "
    "a bare ProcessTopology; None (default): a grid when it has both axes",
    "autotp_size": "also AutoTP's groups._init_tp_mesh_device(tensor_model_parallel_size=...)",
    "model_parallel_size": "also groups._create_model_parallel(model_parallel_size_)",
}
#: Axes ``PipelineModule._index_tied_modules`` knows: it loops over data and model coordinates.
_TIED_AXES: Final = frozenset({"pipe", "data", "model"})

#: Roles: the data axis both loads batches and reduces gradients (ZeRO partitions over it) and
#: the pipeline engine averages the loss over it.
_ROLE_KINDS: Final[Mapping[str, str]] = {
    "data_parallel": "data",
    "gradient_reduce": "data",
    "loss": "data",
    "tensor": "model",
    "pipeline": "pipe",
    "embedding": "embedding",
    "expert": "expert",
    "expert_data": "expert_data",
}


def topology(world_size: int, config: Mapping[str, Any]) -> ProcessTopology:
    """The ``ProcessTopology`` a config describes (see the module docstring)."""
    sizes = {k: config.get(k) for k in ("num_pp", "num_mp", "num_dp")}
    raw = config.get("axes") is not None or config.get("dims") is not None
    if raw:
        if any(v is not None for v in sizes.values()):
            raise LayoutError("give either axes/dims or num_pp/num_mp/num_dp, not both")
        if config.get("axes") is None or config.get("dims") is None:
            raise LayoutError("a raw ProcessTopology needs both axes and dims")
        return ProcessTopology(config["axes"], config["dims"])
    if all(v is None for v in sizes.values()):
        return default_topology(world_size)
    num_pp = _degree("num_pp", 1 if sizes["num_pp"] is None else sizes["num_pp"])
    num_mp = _degree("num_mp", 1 if sizes["num_mp"] is None else sizes["num_mp"])
    num_dp = sizes["num_dp"]
    if num_dp is None:
        num_dp = max(world_size // (num_pp * num_mp), 1)
    num_dp = _degree("num_dp", num_dp)
    if sizes["num_mp"] is None:
        return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
    return PipeModelDataParallelTopology(num_pp=num_pp, num_mp=num_mp, num_dp=num_dp)


def expect(world_size: int, **config: Any) -> Expected:
    """Every group ``PipelineParallelGrid`` (and the MoE groups) build for ``config``.

    Example: ``expect(8, num_pp=2, num_mp=2, num_dp=2)`` has pipe groups ``(0, 4)``, ``(1, 5)``,
    ``(2, 6)``, ``(3, 7)``, data groups ``(0, 2)``, ``(1, 3)``, ... and model groups ``(0, 1)``, ...
    """
    reject_unknown("deepspeed", config, PARAMETERS)
    topo = topology(world_size, config)
    layout = topo.layout
    axes = topo.get_axis_names()
    grid = _is_grid(config.get("grid"), axes)
    if layout.world_size != world_size:
        raise LayoutError(
            f"{topo} covers {layout.world_size} ranks, not the world size {world_size}; the dims "
            "must multiply to the world size"
            + (" (PipelineParallelGrid asserts 'Invalid Grid')" if grid else ""),
            upstream="AssertionError" if grid else None,
        )
    missing = [a for a in ("pipe", "data") if a not in axes]
    if grid and missing:
        raise LayoutError(
            f"PipelineParallelGrid needs the topology's {missing[0]!r} axis: it reads every "
            f"rank's coordinate .{'pipe' if 'pipe' in missing else 'data'} and {topo} has none; "
            "use grid=False for a bare ProcessTopology",
            upstream="AttributeError",
        )
    kinds = {a: layout_kind(layout, a, f"get_axis_comm_lists({a!r})", a) for a in axes}
    if grid:
        kinds.update(_grid_kinds(topo))
    ep = config.get("ep")
    before = bool(config.get("use_data_before_expert_parallel_", False))
    expert_tp = config.get("enable_expert_tensor_parallelism")
    expert_tp = False if expert_tp is None else expert_tp
    if not isinstance(expert_tp, (bool, np.bool_)):
        raise LayoutError(f"enable_expert_tensor_parallelism must be a bool, got {expert_tp!r}")
    mp_size = config.get("mp_size")
    mp_mode = config.get("mp_mode")
    if (mp_size is not None or mp_mode is not None) and ep is None:
        raise LayoutError("mp_size / mp_mode describe the MoE groups: give ep as well")
    if mp_size is not None and expert_tp:
        raise LayoutError(
            "mp_size is the direct _create_expert_and_data_parallel call, "
            "enable_expert_tensor_parallelism the MoE layer's choice: give one of them"
        )
    mp_mode = "tp" if mp_mode is None else mp_mode
    if mp_mode not in MP_MODES:
        raise LayoutError(f"mp_mode must be one of {MP_MODES}, got {mp_mode!r}")
    if ep is not None:
        pp = max(topo.get_dim("pipe"), 1) if grid else 1
        mp = None if mp_size is None else _degree("mp_size", mp_size)
        if mp is not None and mp > 1:
            experts, expert_data = mp_expert_and_data_parallel_ranks(
                world_size, _degree("ep", ep), mp, mp_mode, pp, before
            )
            kinds.update(_expert_pair(experts, expert_data, f"mp_size {mp}, mp_mode {mp_mode!r}"))
        else:
            kinds.update(
                _expert_kinds(topo, world_size, _degree("ep", ep), before, bool(expert_tp), grid)
            )
    kinds.update(_helper_kinds(world_size, config))
    roles = {r: k for r, k in _ROLE_KINDS.items() if k in kinds and kinds[k].available}
    normal = {
        "axes": tuple(axes),
        "dims": tuple(topo.dims),
        "grid": grid,
        "ep": ep,
        "use_data_before_expert_parallel_": before,
        "enable_expert_tensor_parallelism": bool(expert_tp),
        "mp_size": mp_size,
        "mp_mode": mp_mode if mp_size is not None else None,
        "autotp_size": config.get("autotp_size"),
        "model_parallel_size": config.get("model_parallel_size"),
    }
    return Expected("deepspeed", world_size, normal, kinds.values(), roles, layout=layout)


def _is_grid(flag: object, axes: list[str]) -> bool:
    if flag is None:
        return {"pipe", "data"} <= set(axes)
    if not isinstance(flag, (bool, np.bool_)):
        raise LayoutError(f"grid must be True, False or None, got {flag!r}")
    return bool(flag)


def _helper_kinds(world_size: int, config: Mapping[str, Any]) -> dict[str, Kind]:
    """The opt-in ``deepspeed.utils.groups`` helpers: AutoTP and ``_create_model_parallel``."""
    kinds: dict[str, Kind] = {}
    if config.get("autotp_size") is not None:
        data, tensor = autotp_ranks(world_size, _degree("autotp_size", config["autotp_size"]))
        why = "AutoTP _init_tp_mesh_device"
        kinds["groups.get_tensor_model_parallel_group"] = Kind(
            "groups.get_tensor_model_parallel_group", f"{why}: tensor-parallel group", tensor
        )
        kinds["groups.get_model_parallel_group"] = Kind(
            "groups.get_model_parallel_group", f"{why}: model-parallel group (= tensor)", tensor
        )
        kinds["groups.get_data_parallel_group"] = Kind(
            "groups.get_data_parallel_group", f"{why}: data-parallel group", data
        )
    if config.get("model_parallel_size") is not None:
        size = _degree("model_parallel_size", config["model_parallel_size"])
        data, model = create_model_parallel_ranks(world_size, size)
        kinds["_create_model_parallel.data"] = Kind(
            "_create_model_parallel.data", "_create_model_parallel(): its data-parallel group", data
        )
        kinds["_create_model_parallel.model"] = Kind(
            "_create_model_parallel.model",
            "_create_model_parallel(): its model-parallel group",
            model,
        )
    return kinds


def _expert_pair(experts: Groups, expert_data: Groups, path: str) -> dict[str, Kind]:
    return {
        "expert": Kind("expert", f"expert-parallel group (MoE all-to-all; {path})", experts),
        "expert_data": Kind(
            "expert_data",
            f"expert data-parallel group (reduces expert gradients; {path})",
            expert_data,
        ),
    }


def _expert_kinds(
    topo: ProcessTopology, world_size: int, ep: int, before: bool, expert_tp: bool, grid: bool
) -> dict[str, Kind]:
    """``MoE(ep_size=ep, enable_expert_tensor_parallelism=expert_tp)`` 's groups, with
    ``groups.mpu`` the grid (None when the topology is no grid).

    ``MoE._create_process_groups`` takes the expert-tensor-parallel path only when there is an
    mpu *and* the flag is set; otherwise ``_create_expert_and_data_parallel(ep)``, whose pipeline
    size comes from the mpu (1 without one). Example: world 8, mp 2, dp 4, ep 2 gives EP
    groups ``[0, 1]``, ``[2, 3]``, ... by default and ``[0, 2]``, ``[4, 6]``, ``[1, 3]``, ...
    with the flag.
    """
    if grid and expert_tp:
        tp, pp = max(topo.get_dim("model"), 1), max(topo.get_dim("pipe"), 1)
        dp = topo.get_dim("data")  # the mpu's data-parallel world size
        if dp % ep:
            raise LayoutError(
                f"{dp} is not divisible by {ep}: _create_expert_data_and_model_parallel needs "
                f"the grid's data-parallel size to be divisible by the expert parallel size",
                upstream="AssertionError",
            )
        experts, expert_data = expert_parallel_ranks(world_size, tp, ep, pp, before)
        path = "expert tensor parallelism: _get_expert_parallel_ranks"
    else:
        pp = max(topo.get_dim("pipe"), 1) if grid else 1
        experts, expert_data = expert_and_data_parallel_ranks(world_size, ep, pp, before)
        path = "_create_expert_and_data_parallel, tp ignored"
    return _expert_pair(experts, expert_data, path)


def _grid_kinds(topo: ProcessTopology) -> dict[str, Kind]:
    """Groups ``PipelineParallelGrid`` adds to the axis groups."""
    layout = topo.layout
    world = layout.world_size
    axes = topo.get_axis_names()
    pp = topo.get_dim("pipe")
    kinds: dict[str, Kind] = {}
    if "model" not in axes:
        kinds["model"] = Kind(
            "model",
            "slice (tensor) groups: one rank each, the topology has no model axis",
            lambda: Groups(np.arange(world, dtype=np.int64).reshape(-1, 1)),
        )
    replica = [a for a in axes if a != "data"]
    kinds["model_parallel"] = layout_kind(
        layout,
        "model_parallel",
        "get_model_parallel_group(): every rank of one data replica",
        *replica,
    )

    def pairs() -> Groups:
        # Row r is rank r's own pair [r, next stage], as grid.p2p_groups lists them. Every rank
        # also sits second in its previous stage's pair (the pairs form cycles), so the kind is
        # keyed by first member: Expected.group_of(r, "p2p") is (r, next).
        pipes = layout.groups_array("pipe")
        following = np.empty(world, dtype=np.int64)
        following[pipes] = np.roll(pipes, -1, axis=1)
        return Groups(np.stack([np.arange(world, dtype=np.int64), following], axis=1))

    kinds["p2p"] = Kind(
        "p2p",
        "p2p_groups: [rank, next stage] for every rank",
        pairs,
        partition=False,
        keyed_by_first=True,
    )
    if pp > 1:
        description = (
            "tied-layer group of a layer on the first and last stage (embedding / LM head)"
        )
        others = {a: topo.get_dim(a) for a in axes if a not in _TIED_AXES and topo.get_dim(a) > 1}
        if others:
            kinds["embedding"] = Kind("embedding", description, _tied_deadlock(others))
        else:
            kinds["embedding"] = Kind(
                "embedding",
                description,
                lambda: Groups(layout.groups_array("pipe")[:, [0, -1]]),
                partition=pp == 2,
            )
    return kinds


def _tied_deadlock(others: Mapping[str, int]) -> LayoutError:
    """Why a ``PipelineModule`` with tied layers never finishes on a topology with other axes."""
    return LayoutError(
        f"PipelineModule cannot build tied-layer groups on this topology: "
        f"_index_tied_modules loops over the data and model coordinates only and keeps each "
        f"rank's own coordinate on the other axes {dict(others)}, so ranks that differ there pass "
        f"different rank lists to the collective new_group and deadlock (deepspeed 0.19.8); "
        f"use only pipe/data/model axes, or no TiedLayerSpec"
    )


def _degree(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)
