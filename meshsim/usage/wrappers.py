"""What DDP and FSDP2 wrappers say they reduce, read off the live wrapper.

``DistributedDataParallel`` reduces in C++ (its reducer calls the process group directly), so
no Python wrapper sees those all-reduces: what it covers and over which group is *read* from
the wrapper. FSDP2 (``fully_shard``) reduces in Python, so its calls are recorded; its state
says which parameters each reduce-scatter and all-reduce carries. Runs inside a rank; imports
torch lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshsim import torch_private
from meshsim.harness.recorder import group_ranks


@dataclass(frozen=True)
class DdpCover:
    """One DDP wrapper's reduction of one parameter: its group (``None``: the world) and
    whether its last forward armed the backward all-reduce (``False`` under ``no_sync``)."""

    group: tuple[int, ...] | None
    synced: bool


@dataclass(frozen=True)
class FsdpCover:
    """The groups ``fully_shard`` reduces one parameter's gradient over: reduce-scatter over
    ``shard``, then (HSDP) all-reduce over ``replicate``; ``None`` where it has none."""

    shard: tuple[int, ...] | None
    replicate: tuple[int, ...] | None


def ddp_covers(model: Any) -> dict[int, DdpCover]:
    """``id(param)`` -> its DDP reduction, for every DDP wrapper in ``model`` (itself included).

    A parameter DDP ignores (``_ddp_params_and_buffers_to_ignore``, ``delay_all_reduce_named_
    params``) or that needs no gradient is not covered.
    """
    from torch.nn.parallel import DistributedDataParallel

    covers: dict[int, DdpCover] = {}
    for module in model.modules():
        if not isinstance(module, DistributedDataParallel):
            continue
        group = group_ranks(module.process_group)
        # Set by every forward with grad enabled: False when it ran under ``no_sync()``, so the
        # reducer was not armed and the backward reduced nothing.
        synced = bool(getattr(module, "require_forward_param_sync", True))
        ignored = set(getattr(module, "parameters_to_ignore", ()))
        for name, param in module.module.named_parameters():
            if name not in ignored and param.requires_grad:
                covers[id(param)] = DdpCover(group, synced)
    return covers


def fsdp_covers(model: Any) -> dict[int, FsdpCover]:
    """``id(param)`` -> the groups ``fully_shard`` reduces it over, for every FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    covers: dict[int, FsdpCover] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = getattr(torch_private.fsdp_state(module), "_fsdp_param_group", None)
        if param_group is None:
            continue
        info = param_group.mesh_info
        shard = getattr(info, "reduce_scatter_process_group", None) or getattr(
            info, "shard_process_group", None
        )
        replicate = getattr(info, "replicate_process_group", None)
        cover = FsdpCover(
            None if shard is None else _ranks(shard),
            None if replicate is None else _ranks(replicate),
        )
        for fsdp_param in param_group.fsdp_params:
            covers[id(fsdp_param.sharded_param)] = cover
    return covers


def _ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))
