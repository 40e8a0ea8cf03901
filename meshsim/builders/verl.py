"""verl builder: the FSDP engine's and the torchtitan engine's meshes and dispatch, in torch.

FSDP engine (``strategy`` "fsdp"/"fsdp2"): ``create_device_mesh``'s 1-D ``("fsdp",)`` or
``("ddp", "fsdp")`` mesh, the Ulysses ``("dp", "sp")`` mesh beside it, the groups FSDP reduces
gradients over (FSDP1's choice of process group and its NO_SHARD clamp replayed from torch's
``_init_process_group_state`` / ``_init_core_state``), and the dispatch rule read off the live
Ulysses mesh: each rank's ``dp_rank`` and ``is_collect``. Torchtitan engine: meshsim's torchtitan
builder for ``ParallelDims``' axes, then verl's data rank (the ``loss`` mesh's local rank) and
collect rule (tp rank 0, last pp rank, cp rank 0) on those live meshes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim.builders._common import Entry, FrameworkRejection, collect, flatten, mesh
from meshsim.checks import Observation

# verl's torchtitan engine keys and the kinds it reads: config names, shared with the reference.
from meshsim.model.conventions.verl import TITAN_KEYS, TITAN_KINDS


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Example (world 8): ``{"fsdp_size": 1}`` builds a (ddp, fsdp) = (8, 1) mesh, and FSDP1's
    ``fsdp_reduce`` group on rank 3 is ``(3,)`` alone."""
    strategy = config.get("strategy", "fsdp")
    if strategy == "torchtitan":
        return collect(_torchtitan(world_size, config))
    return collect(_fsdp(world_size, strategy, config))


def fsdp_engine_meshes(
    world_size: int, config: Mapping[str, Any]
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``FSDPEngine._init_device_mesh``: the device mesh and the Ulysses mesh (None: sp 1)."""
    fsdp_size = config.get("fsdp_size", -1)
    sp = config.get("ulysses_sequence_parallel_size", 1)
    if fsdp_size < 0 or fsdp_size >= world_size:
        root = mesh((world_size,), ("fsdp",))
    else:
        if fsdp_size == 0:
            raise FrameworkRejection("integer division by zero", upstream="ZeroDivisionError")
        root = mesh((world_size // fsdp_size, fsdp_size), ("ddp", "fsdp"))
    if sp == 0:
        raise FrameworkRejection("integer division by zero", upstream="ZeroDivisionError")
    return root, mesh((world_size // sp, sp), ("dp", "sp")) if sp > 1 else None


def no_shard_clamp(root: DeviceMesh, strategy: str) -> bool:
    """FSDP1 over verl's (ddp, fsdp) mesh with fsdp 1: NO_SHARD in a one-rank group, so no
    gradient is averaged with any other rank's (verl#7493)."""
    return strategy == "fsdp" and root.ndim == 2 and root.size(1) == 1


def _fsdp(world_size: int, strategy: str, config: Mapping[str, Any]) -> dict[str, Entry]:
    sp = config.get("ulysses_sequence_parallel_size", 1)
    root, ulysses = fsdp_engine_meshes(world_size, config)
    entries: dict[str, Entry] = {
        "device_mesh": root,
        "fsdp": root["fsdp"],
        "ddp": root["ddp"] if "ddp" in (root.mesh_dim_names or ()) else KeyError("ddp"),
        "fsdp_reduce": _fsdp_reduce(root, strategy),
    }
    if ulysses is None:
        missing = TypeError("'NoneType' object is not subscriptable")
        entries.update({"dp": missing, "sp": missing, "get_data_parallel_group": dist.group.WORLD})
        me = dist.get_rank()
        entries["dispatch"] = (me,)
        entries["collect"] = tuple(range(world_size))
        return entries
    entries.update(
        {"dp": ulysses["dp"], "sp": ulysses["sp"], "get_data_parallel_group": ulysses["dp"]}
    )
    dp_ranks = ulysses.mesh.new_tensor(range(ulysses.size(0))).reshape(-1, 1).expand(-1, sp)
    collects = ulysses.mesh.new_tensor(range(sp)).reshape(1, -1).expand(ulysses.size(0), -1) == 0
    entries.update(_dispatch(ulysses.mesh, dp_ranks, collects))
    return entries


def _fsdp_reduce(root: DeviceMesh, strategy: str) -> Entry:
    """What FSDP averages gradients over: FSDP1's NO_SHARD clamp keeps a 1-rank shard group."""
    if no_shard_clamp(root, strategy):
        return root.get_group(1)  # HYBRID_SHARD's process_group, clamped to NO_SHARD
    return root


def _dispatch(ranks: torch.Tensor, dp_ranks: torch.Tensor, collects: torch.Tensor) -> dict:
    """``dispatch``: ranks given this rank's dp_rank; ``collect``: collecting ranks in global
    order, held by the collecting ranks only (the controller concatenates their outputs)."""
    flat, dps, cols = ranks.flatten(), dp_ranks.flatten(), collects.flatten()
    me = dist.get_rank()
    mine = int(dps[flat == me][0])
    dispatch = tuple(sorted(int(r) for r in flat[dps == mine].tolist()))
    collectors = tuple(sorted(int(r) for r in flat[cols].tolist()))
    return {"dispatch": dispatch, "collect": collectors if me in collectors else None}


def _torchtitan(world_size: int, config: Mapping[str, Any]) -> dict[str, Entry]:
    from meshsim.builders import torchtitan

    degrees = {TITAN_KEYS[k]: config.get(k, 1) for k in TITAN_KEYS}
    observed = torchtitan.build(world_size, degrees)
    pp, cp, tp = degrees["pp"], degrees["cp"], degrees["tp"]
    if pp < 1 or cp < 1 or tp < 1:
        raise FrameworkRejection("degrees must be >= 1", upstream="AssertionError")
    batch = world_size // (pp * cp * tp)
    if batch * cp == 1:
        raise FrameworkRejection("Invalid mesh dim: 'fsdp'", upstream="ValueError")
    load = mesh((pp, batch, cp, tp), ("pp", "batch", "cp", "tp"))
    loss = flatten(load, ("batch", "cp"), "verl_loss")
    entries: dict[str, Entry] = {}
    for name in TITAN_KINDS:
        entries[name] = _observed(observed, name)
    entries["get_data_parallel_group"] = loss
    grid = load.mesh
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid.shape), indexing="ij"))
    dp_ranks = coords[1] * cp + coords[2]  # the loss mesh's local rank: (batch, cp) row-major
    collects = (coords[3] == 0) & (coords[0] == pp - 1) & (coords[2] == 0)
    entries.update(_dispatch(grid, dp_ranks, collects))
    return entries


def _observed(observed: Observation, name: str) -> Entry:
    """A torchtitan builder kind handed back as a rank list (or absent when it raised)."""
    view = observed.groups.get(name)
    return None if view is None else view.members
