"""DeepSpeed: ``PipelineParallelGrid`` over a ``ProcessTopology``, plus the MoE expert groups.

The topology is ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes pipe, data,
model), ``PipeDataParallelTopology(num_pp, num_dp)`` when ``num_mp`` is not given, a raw
``ProcessTopology(axes, dims)``, or with no config the grid's prime-factor default. Kinds:

* one per topology axis (``get_axis_comm_lists``): ``pipe``, ``data``, ``model`` (the grid's
  slice groups; singletons when the topology has no model axis);
* ``model_parallel``: DeepSpeed's model-parallel group, every pipe × model rank of one replica;
* ``p2p``: DeepSpeed's list of ``[rank, next stage]`` pairs, one per rank, wrapping around;
* ``embedding``: tied-layer groups of ``PipelineModule`` for a layer tied between the first and
  last stage (GPT's embedding/head); DeepSpeed builds none when there is one stage;
* ``expert`` / ``expert_data`` when ``ep`` is given (``_get_expert_parallel_ranks``).
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
}

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
    if ep is not None:
        tp, pp = max(topo.get_dim("model"), 1), max(topo.get_dim("pipe"), 1)
        experts, expert_data = expert_parallel_ranks(world_size, tp, _degree("ep", ep), pp, before)
        kinds["expert"] = Kind("expert", "expert-parallel group (MoE all-to-all)", experts)
        kinds["expert_data"] = Kind(
            "expert_data", "expert data-parallel group (reduces expert gradients)", expert_data
        )
    roles = {role: kind for role, kind in _ROLE_KINDS.items() if kind in kinds}
    normal = {
        "axes": tuple(axes),
        "dims": tuple(topo.dims),
        "ep": ep,
        "use_data_before_expert_parallel_": before,
    }
    return Expected("deepspeed", world_size, normal, kinds.values(), roles, layout=layout)


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
        pipes = layout.groups_array("pipe")
        following = np.empty(world, dtype=np.int64)
        following[pipes] = np.roll(pipes, -1, axis=1)
        return Groups(np.stack([np.arange(world, dtype=np.int64), following], axis=1))

    kinds["p2p"] = Kind(
        "p2p", "p2p_groups: [rank, next stage] for every rank", pairs, partition=False
    )
    if pp > 1:
        kinds["embedding"] = Kind(
            "embedding",
            "tied-layer group of a layer on the first and last stage (embedding / LM head)",
            lambda: Groups(layout.groups_array("pipe")[:, [0, -1]]),
            partition=pp == 2,
        )
    return kinds


def _degree(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every ``PipeModelDataParallelTopology`` of ``world_size``, then each with every MoE
    ``ep > 1`` dividing ``num_dp``, in E + D and D + E layouts (``moe=False`` skips those)."""
    shapes = list(ordered_factorizations(world_size, 3))
    for num_pp, num_mp, num_dp in shapes:
        yield {"num_pp": num_pp, "num_mp": num_mp, "num_dp": num_dp}
    if not options.get("moe", True):
        return
    for num_pp, num_mp, num_dp in shapes:
        for ep in divisors(num_dp)[1:]:
            for before in (False, True):
                yield {
                    "num_pp": num_pp,
                    "num_mp": num_mp,
                    "num_dp": num_dp,
                    "ep": ep,
                    "use_data_before_expert_parallel_": before,
                }
