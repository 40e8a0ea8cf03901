"""accelerate builder: ``ParallelismConfig.build_device_mesh`` and the Accelerator's uses of it,
replayed with plain torch.

The mesh is ``init_device_mesh`` over the sizes > 1 in accelerate's order (dp_replicate,
dp_shard, cp, sp, tp), then ``_flatten`` of ``dp``, ``dp_shard_cp`` and ``dp_cp`` over whichever
of their dims were kept, in that order. Every kind is then asked of the *live* mesh the way
accelerate asks (``mesh[name]``), so a name torch never registered comes back as torch's own
``KeyError``. The data loader's replica groups are ``prepare_data_loader``'s arithmetic over the
live mesh's dim sizes, applied to every rank number; the DeepSpeed AutoTP mesh is
``init_device_mesh`` over ``(autotp_size,)`` alone, as ``_prepare_deepspeed`` builds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import Entry, collect, mesh, new_groups, reference_rules
from meshsim.checks import Observation
from meshsim.model.conventions import accelerate

ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
FLATTENS = (
    ("dp", ("dp_replicate", "dp_shard")),
    ("dp_shard_cp", ("dp_shard", "cp")),
    ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
)
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Every kind accelerate hands out for ``config`` on this rank.

    Example (world 8): ``{"tp_size": 2, "dp_shard_size": 4}`` builds a (dp_shard, tp) = (4, 2)
    mesh; ``tp`` is ``(0, 1)`` on rank 0 and the loader's replica group ``(0, 2, 4, 6)``.
    """
    version, kind, sizes, autotp = settings(config)
    check_world(world_size, config)
    root = build_device_mesh(version, sizes)
    entries: dict[str, Entry] = {}
    for name in (*ORDER, *(n for n, _ in FLATTENS)):
        entries[name] = _ask(root, name)
    if kind == "FSDP":
        entries["fsdp_mesh"] = _fsdp_mesh(root)
    elif kind == "MULTI_GPU" and sizes["tp"] == 1:
        entries["ddp"] = dist.group.WORLD
    loader_mesh = root
    if kind == "DEEPSPEED" and autotp > 1:
        loader_mesh = mesh((autotp,), ("tp",))
        entries["ds:tp"] = loader_mesh if dist.get_rank() < autotp else None
    if version == "1.15" and kind == "DEEPSPEED" and sizes["sp"] > 1:
        # DeepSpeed's initialize_sequence_parallel: sp consecutive ranks, and the world.
        sp = sizes["sp"]
        entries["ds:sp"] = new_groups([range(i, i + sp) for i in range(0, world_size, sp)])
        entries["ds:sp_dp"] = dist.group.WORLD
    dispatch = bool(config.get("dispatch_batches"))
    replica, peers = _loader_groups(world_size, kind, loader_mesh, dispatch)
    entries["dataloader_replica"] = replica
    entries["dataloader_batch_peers"] = peers
    return collect(entries)


def meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, DeviceMesh]:
    """The ParallelismConfig mesh (none when accelerate builds none)."""
    version, _, sizes, _ = settings(config)
    check_world(world_size, config)
    root = build_device_mesh(version, sizes)
    return {} if root is None else {"main": root}


def settings(config: Mapping[str, Any]) -> tuple[str, str, dict[str, int], int]:
    """Version, distributed type, sizes by dim and AutoTP size, as the convention reads them;
    the checks against the world are :func:`check_world`'s."""
    with reference_rules():
        cfg = accelerate.normalize(config)
    sizes = {key[: -len("_size")]: cfg[key] for key in SIZE_KEYS}
    return cfg["version"], cfg["distributed_type"], sizes, cfg["autotp_size"] or 0


def check_world(world_size: int, config: Mapping[str, Any]) -> None:
    """``__post_init__``, ``AcceleratorState``'s CP check, ``init_device_mesh``'s size check,
    ``_validate_accelerator`` and the AutoTP mesh's size check, in accelerate's order: the
    convention's statement of them."""
    with reference_rules():
        accelerate.check_config(world_size, accelerate.normalize(config))


def build_device_mesh(version: str, sizes: Mapping[str, int]) -> DeviceMesh | None:
    """``ParallelismConfig.build_device_mesh``: kept dims, then the three flattens."""
    if version == "1.15" and sizes["sp"] > 1:
        return None  # DeepSpeed builds its own SP groups
    kept = [d for d in ORDER if sizes[d] > 1]
    if not kept:
        return None
    root = mesh([sizes[d] for d in kept], kept)
    for name, dims in FLATTENS:
        present = [d for d in dims if d in kept]
        if present:
            torch_private.flatten(root[tuple(present)], name)
    return root


def _ask(root: DeviceMesh | None, name: str) -> Entry:
    """``mesh[name]`` as accelerate asks it, or what that raises."""
    try:
        return root[name]  # type: ignore[index]
    except (KeyError, TypeError) as error:
        return error


def _fsdp_mesh(root: DeviceMesh | None) -> Entry:
    """``fsdp2_prepare_model``'s ``mesh[fsdp_dim_names]``; no mesh: torch's world mesh."""
    if root is None:
        return dist.group.WORLD
    names = tuple(root.mesh_dim_names or ())
    dims = (("dp_replicate",) if "dp_replicate" in names else ()) + ("dp_shard_cp",)
    try:
        return root[dims]
    except KeyError as error:
        return error


def _loader_groups(
    world_size: int, kind: str, loader_mesh: DeviceMesh | None, dispatch: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``prepare_data_loader``: ``process_index // block``, ``block`` from the mesh's ``tp``
    (and, outside DeepSpeed, ``cp``) sizes; this rank's DP group (same place in its block,
    one rank per replica index) and the ranks loading the same batches. ``DataLoaderDispatcher``
    instead sends every rank the same batch when the mesh has ``tp``, else each its own."""
    block = _block(kind, loader_mesh)
    if dispatch:
        names = tuple(loader_mesh.mesh_dim_names or ()) if loader_mesh is not None else ()
        block = world_size if "tp" in names else 1
    index = [r // block for r in range(world_size)]
    rank = dist.get_rank()
    peers = tuple(r for r in range(world_size) if index[r] == index[rank])
    place = peers.index(rank)
    replica = tuple(
        sorted(
            (r for r in range(world_size) if _place(index, r) == place),
            key=lambda r: index[r],
        )
    )
    return replica, peers


def loader_rank(world_size: int, kind: str, loader_mesh: DeviceMesh | None) -> tuple[int, int]:
    """``prepare_data_loader``'s (process_index, num_processes) for this rank."""
    rank = dist.get_rank()
    if loader_mesh is None:
        return rank, world_size
    block = _block(kind, loader_mesh)
    if kind == "DEEPSPEED":
        return rank // block, world_size // block
    names = tuple(loader_mesh.mesh_dim_names or ())
    dp = [loader_mesh[d].size() for d in ("dp_replicate", "dp_shard") if d in names]
    return rank // block, math.prod(dp)


def _block(kind: str, loader_mesh: DeviceMesh | None) -> int:
    """The divisor of the process index: the mesh's tp (and, outside DeepSpeed, cp) size."""
    names = tuple(loader_mesh.mesh_dim_names or ()) if loader_mesh is not None else ()
    block = 1
    for dim in ("tp",) if kind == "DEEPSPEED" else ("tp", "cp"):
        if dim in names:
            block *= loader_mesh[dim].size()  # type: ignore[index]
    return block


def _place(index: list[int], rank: int) -> int:
    """``rank``'s position among the ranks sharing its replica index."""
    return sum(1 for r in range(rank) if index[r] == index[rank])
