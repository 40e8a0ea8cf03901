"""AReaL Archon builder: ``ArchonParallelDims.build_mesh``'s recipe replayed on live torch meshes.

``__post_init__``'s inference and ``ValueError`` checks run first; then ``init_device_mesh``
builds ``(pp, dp_shard, cp, tp)`` (or the EP root with ``dp_shard_mod_ep``/``dp_shard_in_ep``)
and ``_flatten`` registers, in AReaL's order, every name ``get_mesh`` hands out; ``ep_tp`` is the
live 2-D ``root["ep", "tp"]`` slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import Entry, FrameworkRejection, collect, mesh
from meshsim.checks import Observation

_KEYS = ("dp_shard", "cp", "tp", "pp", "ep", "etp", "dp_replicate")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Every mesh ``get_mesh`` would return, observed by the name it is asked for."""
    return collect(_named_meshes(world_size, config))


def meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, DeviceMesh]:
    """The world mesh ``ArchonParallelDims`` builds (``meshsim meshes``)."""
    root = _named_meshes(world_size, config)["pp"]
    return {"main": torch_private.root_mesh(root)}


def _degrees(world_size: int, config: Mapping[str, Any]) -> tuple[int, ...]:
    defaults = {"dp_shard": -1}
    values = [config.get(key, defaults.get(key, 1)) for key in _KEYS]
    for key, value in zip(_KEYS, values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise FrameworkRejection(f"{key} must be an integer, got {value!r}", upstream=None)
    dp_shard, cp, tp, pp, ep, etp, _ = values
    if dp_shard < 0:
        if tp * cp * pp == 0:
            raise FrameworkRejection("integer division by zero", upstream="ZeroDivisionError")
        dp_shard = world_size // (tp * cp * pp)
    if dp_shard * tp * cp * pp != world_size:
        raise FrameworkRejection(
            "dp_shard * tp * cp * pp must equal world_size", upstream="ValueError"
        )
    if etp not in (1, tp):
        raise FrameworkRejection("etp must be 1 or equal to tp", upstream="ValueError")
    if ep > 1:
        borrowed = cp if etp == tp else cp * tp
        if ep % borrowed != 0 or dp_shard * borrowed % ep != 0:
            raise FrameworkRejection("ep does not fit dp_shard x cp (x tp)", upstream="ValueError")
    return dp_shard, cp, tp, pp, ep, etp


def _named_meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, Entry]:
    dp_shard, cp, tp, pp, ep, etp = _degrees(world_size, config)
    if ep <= 1:
        dp_dims: tuple[str, ...] = ("dp_shard",)
        root = mesh((pp, dp_shard, cp, tp), ("pp", "dp_shard", "cp", "tp"))
    else:
        dp_dims = ("dp_shard_mod_ep", "dp_shard_in_ep")
        if etp == tp:
            split = (dp_shard * cp // ep, ep // cp)
        else:
            split = (dp_shard * cp * tp // ep, ep // (cp * tp))
        root = mesh((pp, *split, cp, tp), ("pp", *dp_dims, "cp", "tp"))
    out: dict[str, Entry] = {dim: root[dim] for dim in root.mesh_dim_names or ()}
    out["dp"] = torch_private.flatten(root[dp_dims], "dp")
    out["dp_shard_cp"] = torch_private.flatten(root[(*dp_dims, "cp")], "dp_shard_cp")
    out["dp_cp"] = torch_private.flatten(root[(*dp_dims, "cp")], "dp_cp")
    out["pp_cp_tp"] = torch_private.flatten(root["pp", "cp", "tp"], "pp_cp_tp")
    if ep > 1:
        if etp == tp:
            ep_dims = ("dp_shard_in_ep", "cp") if cp > 1 else ("dp_shard_in_ep",)
            torch_private.flatten(root[ep_dims], "ep")
            out["ep"] = root["ep"]
            out["ep_tp"] = root["ep", "tp"]
        else:
            out["ep"] = torch_private.flatten(root["dp_shard_in_ep", "cp", "tp"], "ep")
    return out
