"""AReaL FSDP builder: ``ParallelHelper.build_mesh``'s recipe replayed on live torch meshes.

The strategy's checks run in AReaL's order (``ParallelStrategy.__post_init__``, the pipeline
assert, ``ParallelHelper._validate``), then ``init_device_mesh`` builds ``(dp, sp, tp)`` or, with
EP, ``(dp_mod_ep, dp_in_ep, sp, tp)`` and ``_flatten`` registers ``dp``/``dp_sp``/``sp_tp``/``ep``
on the live root in AReaL's order, so torch decides which ranks each name holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import Entry, FrameworkRejection, collect, mesh, require
from meshsim.checks import Observation

_KEYS = (
    "data_parallel_size",
    "context_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "expert_tensor_parallel_size",
)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Every root dim and flattened name of the mesh, observed by its AReaL name."""
    root = build_mesh(world_size, config)
    entries: dict[str, Entry] = {dim: root[dim] for dim in root.mesh_dim_names or ()}
    for name in torch_private.flatten_mapping(root):
        entries[name] = root[name]
    return collect(entries)


def meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, DeviceMesh]:
    """The one mesh ``ParallelHelper`` builds (``meshsim meshes``)."""
    return {"main": build_mesh(world_size, config)}


def _degrees(config: Mapping[str, Any]) -> tuple[int, ...]:
    values = tuple(config.get(key, 1) for key in _KEYS)
    for key, value in zip(_KEYS, values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise FrameworkRejection(f"{key} must be an integer, got {value!r}", upstream=None)
    return values


def build_mesh(world_size: int, config: Mapping[str, Any]) -> DeviceMesh:
    dp, sp, tp, pp, ep, etp = _degrees(config)
    if ep > 1:  # ParallelStrategy.__post_init__ (its world_size is dp * cp * tp * pp)
        emp = pp * etp * ep
        if emp == 0:
            raise FrameworkRejection("integer modulo by zero", upstream="ZeroDivisionError")
        require(dp * sp * tp * pp % emp == 0, f"Expert model parallel size {emp} cannot divide")
    require(pp == 1, "Pipeline parallelism is not supported in FSDP")
    require(min(sp, tp, ep, etp) >= 1, "Parallelism degree should be >= 1")
    if ep > 1:
        require(etp in (tp, 1), "Currently we only support ETP=TP or ETP=1")
        borrowed = sp if etp == tp else sp * tp
        require(ep % borrowed == 0 and dp * borrowed % ep == 0, "ep must divide dp x borrowed")
    _check_world(world_size, dp, sp, tp)
    if ep <= 1:
        root = mesh((dp, sp, tp), ("dp", "sp", "tp"))
        torch_private.flatten(root["dp", "sp"], "dp_sp")
        torch_private.flatten(root["sp", "tp"], "sp_tp")
        return root
    if etp == tp:
        shape, ep_dims = (dp * sp // ep, ep // sp), ("dp_in_ep", "sp")
    else:
        shape, ep_dims = (dp * sp * tp // ep, ep // (sp * tp)), ("dp_in_ep", "sp", "tp")
    root = mesh((*shape, sp, tp), ("dp_mod_ep", "dp_in_ep", "sp", "tp"))
    torch_private.flatten(root["dp_mod_ep", "dp_in_ep"], "dp")
    torch_private.flatten(root["dp_mod_ep", "dp_in_ep", "sp"], "dp_sp")
    torch_private.flatten(root["sp", "tp"], "sp_tp")
    torch_private.flatten(root[ep_dims], "ep")
    return root


def _check_world(world_size: int, dp: int, sp: int, tp: int) -> None:
    """What torch 2.10 does with a strategy that is not the world, on every rank alike: a
    bad dp dim fails in ``init_device_mesh``, a mesh bigger than the world is refused, and a
    smaller one leaves the ranks outside it failing (IndexError) at the first slice."""
    if dp < 1:
        raise FrameworkRejection(
            f"mesh shape ({dp}, {sp}, {tp})",
            upstream="AssertionError" if dp == 0 else "RuntimeError",
        )
    size = dp * sp * tp
    if size > world_size:
        raise FrameworkRejection(
            f"Mesh should not be bigger than default world size {world_size}, but found {size} "
            "ranks!",
            upstream="RuntimeError",
        )
    if size < world_size:
        raise FrameworkRejection(
            f"the mesh of {size} ranks leaves ranks {size}-{world_size - 1} out; they fail "
            "slicing it",
            upstream="IndexError",
        )
