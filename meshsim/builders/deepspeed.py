"""DeepSpeed builder: ``PipelineParallelGrid`` over a ``ProcessTopology``, plus MoE groups.

A ``ProcessTopology(axes, dims)`` (last axis fastest) is ``init_device_mesh(dims, axes)``: each
axis's communicator lists are that dim's groups, DeepSpeed's model-parallel group is the
``_flatten`` of every non-data axis, tied-embedding groups are ``new_group`` s over the first and
last stage of torch's pipe groups (none when another axis of size > 1 would deadlock
``PipelineModule``), and the MoE expert / expert-data groups are the two halves of an
``_unflatten`` of a data-parallel dim (E + D: experts inner; D + E: experts outer): the dense
one strided by tp for ``enable_expert_tensor_parallelism=True`` with a grid, or every rank of a
pipeline stage, tp ignored, for DeepSpeed's default path. With ``mp_size > 1`` the stage is a
``(stage / mp, mp)`` mesh: ``"tp"`` mode unflattens the flattened ``(mp, stage / mp)`` transpose
(lane-major), ``"sp"`` the stage itself. AutoTP and ``_create_model_parallel`` are the two dims
of a ``(world / size, size)`` mesh. ``grid=True`` over a topology lacking ``pipe`` or ``data``
is refused as ``PipelineParallelGrid`` fails (``AttributeError``).
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Mapping, Sequence
from typing import Any

from meshsim import torch_private
from meshsim.builders._common import (
    Entry,
    FrameworkRejection,
    all_groups,
    collect,
    degree,
    flatten,
    mesh,
    new_groups,
    require,
)
from meshsim.checks import Observation


def topology(world_size: int, config: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    """The (axes, dims) of the topology a config names (raw, pipe/model/data, or the default)."""
    if config.get("axes") is not None or config.get("dims") is not None:
        if any(config.get(k) is not None for k in ("num_pp", "num_mp", "num_dp")):
            raise FrameworkRejection("give either axes/dims or num_pp/num_mp/num_dp", upstream=None)
        axes, dims = list(config.get("axes") or ()), [int(d) for d in config.get("dims") or ()]
        if len(axes) > len(dims):
            raise FrameworkRejection("list index out of range", upstream="IndexError")
        if len(axes) < len(dims):
            raise FrameworkRejection(f"{len(dims)} dims for axes {axes}", upstream=None)
        valid = all(
            isinstance(a, str) and a.isidentifier() and not keyword.iskeyword(a) and a[0] != "_"
            for a in axes
        )
        if not valid or len(set(axes)) != len(axes):
            raise FrameworkRejection(f"Invalid ProcessCoord fields {axes}", upstream="ValueError")
        return axes, dims
    if all(config.get(k) is None for k in ("num_pp", "num_mp", "num_dp")):
        return ["pipe", "data"], list(_default_pipe_data(world_size))
    num_pp = degree(config, "num_pp")
    num_mp = degree(config, "num_mp")
    num_dp = degree(config, "num_dp", max(world_size // (num_pp * num_mp), 1))
    if config.get("num_mp") is None:
        return ["pipe", "data"], [num_pp, num_dp]
    return ["pipe", "data", "model"], [num_pp, num_dp, num_mp]


def _next_stage_pair(root: Any) -> tuple[int, int]:
    """This rank's ``[rank, next stage]`` pair, read off its live pipe group (wrapping)."""
    import torch.distributed as dist

    stages = [int(r) for r in root["pipe"].mesh.tolist()]
    me = dist.get_rank()
    return me, stages[(stages.index(me) + 1) % len(stages)]


def _default_pipe_data(world_size: int) -> tuple[int, int]:
    """The grid's default: the world's prime factors, ascending, dealt to pipe and data in turn."""
    sizes = [1, 1]
    n, p, index = world_size, 2, 0
    while n > 1:
        while n % p == 0:
            sizes[index % 2] *= p
            index += 1
            n //= p
        p += 1
    return sizes[0], sizes[1]


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    axes, dims = topology(world_size, config)
    flag = config.get("grid")
    grid = {"pipe", "data"} <= set(axes) if flag is None else bool(flag)
    if math.prod(dims) != world_size:
        raise FrameworkRejection(
            "Invalid Grid"
            if grid
            else f"topology covers {math.prod(dims)} ranks, not {world_size}",
            upstream="AssertionError" if grid else None,
        )
    lacking = [a for a in ("pipe", "data") if a not in axes]
    if grid and lacking:
        raise FrameworkRejection(
            f"'ProcessCoord' has no attribute {lacking[0]!r}", upstream="AttributeError"
        )
    root = mesh(dims, axes)
    entries: dict[str, Entry] = {axis: root[axis] for axis in axes}
    if grid:
        if "model" not in axes:  # the grid's slice groups: every rank alone
            entries["model"] = new_groups([[r] for r in range(world_size)])
        replica = [a for a in axes if a != "data"]
        entries["model_parallel"] = flatten(root, replica, "model_parallel")
        entries["p2p"] = _next_stage_pair(root)
        pp = dims[axes.index("pipe")]
        others = [a for a, d in zip(axes, dims) if a not in ("pipe", "data", "model") and d > 1]
        if pp > 1 and others:  # PipelineModule would deadlock: no tied group exists
            entries["embedding"] = FrameworkRejection(f"tied groups deadlock with axes {others}")
        elif pp > 1:
            entries["embedding"] = new_groups([[g[0], g[-1]] for g in all_groups(root, ["pipe"])])
    if config.get("ep") is not None:
        ep = degree(config, "ep")
        before = bool(config.get("use_data_before_expert_parallel_", False))
        if grid and config.get("enable_expert_tensor_parallelism", False):
            tp = dims[axes.index("model")] if "model" in axes else 1
            pp = dims[axes.index("pipe")]
            data = dims[axes.index("data")]
            require(data % ep == 0, f"{data} is not divisible by {ep}")
            entries.update(_expert_groups(world_size, tp, ep, pp, before))
        elif (config.get("mp_size") or 1) > 1:  # the direct call with mp_size
            pp = dims[axes.index("pipe")] if grid else 1
            entries.update(_mp_expert_groups(world_size, ep, config, pp, before))
        else:  # _create_expert_and_data_parallel: the mpu's pp (none without a grid), tp ignored
            pp = dims[axes.index("pipe")] if grid else 1
            require((world_size // pp) % ep == 0, f"{world_size // pp} is not divisible by {ep}")
            entries.update(_expert_groups(world_size, 1, ep, pp, before))
    for key, names in _HELPERS.items():
        if config.get(key) is not None:
            size = min(degree(config, key), world_size)
            require(world_size % size == 0, f"{world_size} is not divisible by {size}")
            split = mesh((world_size // size, size), ("helper_data", "helper_model"))
            for name, dim in zip(names, ("helper_data", "helper_model", "helper_model")):
                entries[name] = split[dim]
    return collect(entries)


#: Opt-in groups.py helpers: (data kind, model kind[, second model kind]) of a (world/size, size)
#: mesh. AutoTP's model-parallel group is its tensor group.
_HELPERS: dict[str, tuple[str, ...]] = {
    "autotp_size": (
        "groups.get_data_parallel_group",
        "groups.get_tensor_model_parallel_group",
        "groups.get_model_parallel_group",
    ),
    "model_parallel_size": ("_create_model_parallel.data", "_create_model_parallel.model"),
}


def _mp_expert_groups(
    world_size: int, ep: int, config: Mapping[str, Any], pp: int, before: bool
) -> dict[str, Entry]:
    """``_create_expert_and_data_parallel(ep, mp_size, mp_mode)`` with mp > 1: each stage's
    ranks, reordered lane-major for ``"tp"``, cut into EP chunks; expert DP zips the chunks."""
    mp = degree(config, "mp_size")
    mode = config.get("mp_mode") or "tp"
    require(not before, "not supported with mp_size > 1", upstream="NotImplementedError")
    stage = world_size // pp
    require(stage % ep == 0, f"{stage} is not divisible by {ep}")
    require(mode != "tp" or stage % mp == 0, f"mp {mp} leaves ranks of a {stage}-rank stage out")
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world_size).reshape(pp, stage // mp, mp)
    if mode == "tp":  # lane-major inside each stage
        ranks = ranks.transpose(1, 2)
    device = "cuda" if str(torch.distributed.get_backend()) == "nccl" else "cpu"
    dense = DeviceMesh(
        device,
        ranks.reshape(pp, stage // ep, ep),
        mesh_dim_names=("moe_pipe", "expert_data", "expert"),
    )
    return {"expert": dense["expert"], "expert_data": dense["expert_data"]}


def _expert_groups(world_size: int, tp: int, ep: int, pp: int, before: bool) -> dict[str, Entry]:
    """``_get_expert_parallel_ranks``: DP groups stride by tp inside a stage; EP takes chunks.

    With tp 1 this is also ``_create_expert_and_data_parallel`` (a stage's ranks, consecutive).
    """
    require(world_size % (tp * pp) == 0, f"world {world_size} not divisible by tp*pp {tp * pp}")
    dp = world_size // (tp * pp)
    require(dp % ep == 0, f"data parallel size {dp} not divisible by expert parallel size {ep}")
    dense = mesh((pp, dp, tp), ("moe_pipe", "moe_data", "moe_model"))
    order: Sequence[tuple[str, int]] = (
        (("expert", ep), ("expert_data", dp // ep))
        if before
        else (("expert_data", dp // ep), ("expert", ep))
    )
    sizes, names = tuple(s for _, s in order), tuple(n for n, _ in order)
    split = torch_private.unflatten(dense, "moe_data", sizes, names, emulate=True)
    return {"expert": split["expert"], "expert_data": split["expert_data"]}
