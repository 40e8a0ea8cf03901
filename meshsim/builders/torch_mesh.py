"""torch DeviceMesh builder: ``init_device_mesh`` plus the config's flatten / unflatten ops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshsim import torch_private
from meshsim.builders._common import Entry, FrameworkRejection, collect, mesh
from meshsim.builders.real._shims import register_fake_backend
from meshsim.checks import Observation
from meshsim.model.conventions.torch_mesh import LOCAL_RANK_KIND, _parse_op


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Build the root mesh, apply each op with torch, observe every dim and flattened name.

    Ops act on the first view (the root, then each unflattened mesh) that knows every dim they
    name, knowing being decided by torch (``mesh_dim_names`` plus the names flattened on the
    view's root), not by the reference; an unflatten of a dim given by index acts on the root.
    Torch's own errors (KeyError for a bad slice, ValueError for a reused flatten name, ...)
    propagate unchanged.
    """
    views = [_root(world_size, config)]
    for op in config.get("ops", ()):
        verb, args = _parse_op(op)
        if verb == "unflatten" and isinstance(args[0], int):
            views.append(torch_private.unflatten(views[0], *args))  # an index: the root's dim
            continue
        wanted = args[0] if verb == "flatten" else (args[0],)
        for view in views:
            if set(wanted) <= _known(view):
                if verb == "flatten":
                    dims, name = args
                    torch_private.flatten(view[tuple(dims)], name)
                else:
                    views.append(torch_private.unflatten(view, *args))
                break
        else:
            raise FrameworkRejection(
                f"{verb} names dims {wanted} that no mesh view holds together", upstream=None
            )
    entries: dict[str, Entry] = {LOCAL_RANK_KIND: _local_rank_group(views[0])}
    for view in views:
        for dim in view.mesh_dim_names or ():
            entries.setdefault(dim, view[dim])
        for name, flat in torch_private.flatten_mapping(view).items():
            entries.setdefault(name, flat)
    return collect(entries)


def _local_rank_group(root: DeviceMesh) -> Entry:
    """The group ``root.get_local_rank()`` indexes, or the error torch raises for it."""
    try:
        local = root.get_local_rank()
    except RuntimeError as error:
        return error
    group = root.get_group()
    if dist.get_rank(group) != local:
        raise AssertionError(
            f"get_local_rank() is {local} but this rank is {dist.get_rank(group)} in get_group()"
        )
    return group


def _known(view: DeviceMesh) -> set[str]:
    return set(view.mesh_dim_names or ()) | set(torch_private.flatten_mapping(view))


def _root(world_size: int, config: Mapping[str, Any]) -> DeviceMesh:
    if "mesh" in config:
        tensor = torch.tensor(config["mesh"], dtype=torch.int)
        names = config.get("mesh_dim_names")
        if names is None:
            names = ("world",) if tensor.ndim == 1 else tuple(f"dim{i}" for i in range(tensor.ndim))
        device = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
        return DeviceMesh(device, tensor, mesh_dim_names=tuple(names))
    shape = tuple(config.get("mesh_shape", (world_size,)))
    names = config.get("mesh_dim_names")
    if names is None:
        names = ("world",) if len(shape) == 1 else tuple(f"dim{i}" for i in range(len(shape)))
    if len(shape) == len(names) and math.prod(shape) < world_size:
        # torch builds it and leaves the other ranks out; meshsim models whole worlds only.
        raise FrameworkRejection(
            f"mesh_shape {shape} covers {math.prod(shape)} of {world_size} ranks", upstream=None
        )
    override = config.get("backend_override")
    if override is None:
        return mesh(shape, tuple(names))
    return _with_override(shape, tuple(names), override)


def _with_override(shape: tuple[int, ...], names: tuple[str, ...], override: Any) -> DeviceMesh:
    """``init_device_mesh(..., backend_override=...)``; torch's refusals become rejections.

    torch rejects a bad value only when it builds that dim's groups, some as TypeError or
    AttributeError (a value that is no ``(backend, options)`` pair); those are the config's
    fault, not the builder's, so they are reported with torch's exception type.
    """
    if not isinstance(override, Mapping):
        raise FrameworkRejection(
            f"backend_override must be a dict, got {type(override).__name__}", upstream=None
        )
    if "fake" in repr(override):
        register_fake_backend()
    for value in override.values():
        # torch checks a name per group it creates, so ranks fail at different groups (a hang
        # on a real backend); ask torch's own registry up front so every rank refuses alike.
        name = value if isinstance(value, str) else None
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], str):
            name = value[0]
        plain = name and "," not in name and ":" not in name
        if plain and name not in dist.Backend.backend_type_map:
            raise FrameworkRejection(f"Unknown backend type {name}", upstream="AssertionError")
    device = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
    try:  # a copy: torch pops the keys it uses from the caller's dict
        return init_device_mesh(
            device, shape, mesh_dim_names=names, backend_override=dict(override)
        )
    except (TypeError, AttributeError) as error:
        raise FrameworkRejection(str(error), upstream=type(error).__name__) from error
