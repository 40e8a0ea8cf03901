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
  ``True`` and a grid, ``_create_expert_data_and_model_parallel`` (``_get_expert_parallel_ranks``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown
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
from meshsim.model.sweep import divisors, ordered_factorizations

__all__ = [
    "PARAMETERS",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "configs",
    "default_topology",
    "expect",
    "expert_and_data_parallel_ranks",
    "expert_parallel_ranks",
    "prime_factors",
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
    grid = {"pipe", "data"} <= set(axes)
    if layout.world_size != world_size:
        raise LayoutError(
            f"{topo} covers {layout.world_size} ranks, not the world size {world_size}; the dims "
            "must multiply to the world size"
            + (" (PipelineParallelGrid asserts 'Invalid Grid')" if grid else ""),
            upstream="AssertionError" if grid else None,
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
    if ep is not None:
        kinds.update(_expert_kinds(topo, world_size, _degree("ep", ep), before, bool(expert_tp)))
    roles = {r: k for r, k in _ROLE_KINDS.items() if k in kinds and kinds[k].available}
    normal = {
        "axes": tuple(axes),
        "dims": tuple(topo.dims),
        "ep": ep,
        "use_data_before_expert_parallel_": before,
        "enable_expert_tensor_parallelism": bool(expert_tp),
    }
    return Expected("deepspeed", world_size, normal, kinds.values(), roles, layout=layout)


def _expert_kinds(
    topo: ProcessTopology, world_size: int, ep: int, before: bool, expert_tp: bool
) -> dict[str, Kind]:
    """``MoE(ep_size=ep, enable_expert_tensor_parallelism=expert_tp)`` 's groups, with
    ``groups.mpu`` the grid (None when the topology is no grid).

    ``MoE._create_process_groups`` takes the expert-tensor-parallel path only when there is an
    mpu *and* the flag is set; otherwise ``_create_expert_and_data_parallel(ep)``, whose pipeline
    size comes from the mpu (1 without one). Example: world 8, mp 2, dp 4, ep 2 gives EP
    groups ``[0, 1]``, ``[2, 3]``, ... by default and ``[0, 2]``, ``[4, 6]``, ``[1, 3]``, ...
    with the flag.
    """
    grid = {"pipe", "data"} <= set(topo.get_axis_names())
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
    return {
        "expert": Kind("expert", f"expert-parallel group (MoE all-to-all; {path})", experts),
        "expert_data": Kind(
            "expert_data",
            f"expert data-parallel group (reduces expert gradients; {path})",
            expert_data,
        ),
    }


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


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every ``PipeModelDataParallelTopology`` of ``world_size``, then each with every MoE
    ``ep > 1`` dividing ``num_dp``, in E + D and D + E layouts, each with
    ``enable_expert_tensor_parallelism`` False and True (``moe=False`` skips those). The two
    MoE paths differ only when ``num_mp > 1``; both are swept everywhere so that the sweep shows
    they agree otherwise. World 8 gives 50 configs."""
    shapes = list(ordered_factorizations(world_size, 3))
    for num_pp, num_mp, num_dp in shapes:
        yield {"num_pp": num_pp, "num_mp": num_mp, "num_dp": num_dp}
    if not options.get("moe", True):
        return
    for num_pp, num_mp, num_dp in shapes:
        for ep in divisors(num_dp)[1:]:
            for before in (False, True):
                for expert_tp in (False, True):
                    yield {
                        "num_pp": num_pp,
                        "num_mp": num_mp,
                        "num_dp": num_dp,
                        "ep": ep,
                        "use_data_before_expert_parallel_": before,
                        "enable_expert_tensor_parallelism": expert_tp,
                    }
