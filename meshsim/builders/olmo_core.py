"""OLMo-core builder: ``build_world_mesh`` and every ``get_*_mesh`` getter, on live torch meshes.

The world mesh is ``init_device_mesh`` over OLMo's dim order (pp, dp | dp_replicate+dp_shard,
cp, tp); the getters then slice and ``_flatten`` the *live* root mesh in exactly OLMo's sequence
(``_flatten_dims`` registering ``dp_ep`` / ``dp`` / ``dp_cp`` on the root, then slicing the root
by the new names), so torch, not meshsim, decides which ranks each getter returns. A getter that
raises in OLMo raises here too and is recorded as absent, so the diff can tell whether the
reference agrees that it raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import Entry, FrameworkRejection, collect, mesh, reference_rules
from meshsim.checks import Observation
from meshsim.model.conventions import olmo_core

Names = tuple[str, ...]


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """World mesh (and the expert mesh when ``expert_mesh_ep`` is set), observed by kind."""
    world = build_world_mesh(world_size, config)
    entries = _mesh_entries(world, prefix="")
    if config.get("expert_mesh_ep") is not None:
        expert = build_expert_parallel_mesh(world_size, config["expert_mesh_ep"])
        entries.update(_mesh_entries(expert, prefix="expert:"))
    return collect(entries)


def meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, DeviceMesh]:
    """The meshes OLMo builds, named as the reference names them (``meshsim meshes``)."""
    built = {"main": build_world_mesh(world_size, config)}
    if config.get("expert_mesh_ep") is not None:
        built["expert"] = build_expert_parallel_mesh(world_size, config["expert_mesh_ep"])
    return built


def build_world_mesh(world_size: int, config: Mapping[str, Any]) -> DeviceMesh:
    """OLMo's ``build_world_mesh``: validate in OLMo's order, build, create the DP group."""
    with reference_rules():
        dims = olmo_core.world_dims(world_size, config)
    names = [name for name, _ in dims]
    sizes = [size for _, size in dims]
    if all(config.get(key) is None for key in ("dp", "pp", "cp", "tp", "ep")):
        return mesh(sizes, names)  # no parallel config: a plain 1-D dp mesh, no DP group
    _check_mesh_covers_world(world_size, names, sizes)
    world = mesh(sizes, names)
    get_dp_process_group(world)  # OLMo creates the DP group eagerly
    return world


def _check_mesh_covers_world(world_size: int, names: list[str], dims: list[int]) -> None:
    """OLMo hands an HSDP split whose product is not the DP world to ``init_device_mesh``.

    A size-0 dim fails in torch with ZeroDivisionError and a mesh bigger than the world with
    RuntimeError, on every rank. A smaller mesh is built on ranks ``0..n-1``; the ranks outside it
    then fail in ``get_dp_process_group``: IndexError in ``get_group`` when the DP mesh spans the
    whole world mesh (other dims of size 1), RuntimeError slicing it otherwise. Every rank
    refuses here with the type the ranks outside the mesh see, as the reference does.
    """
    size = math.prod(dims)
    if size == world_size:
        return
    if size == 0:
        raise FrameworkRejection("integer modulo by zero", upstream="ZeroDivisionError")
    if size > world_size:
        raise FrameworkRejection(
            f"Mesh should not be bigger than default world size {world_size}, but found {size} "
            "ranks!",
            upstream="RuntimeError",
        )
    dp_size = math.prod(d for n, d in zip(names, dims) if n.startswith("dp"))
    whole = dp_size == size  # no pp/cp/tp dim of size > 1: the DP mesh is the world mesh
    raise FrameworkRejection(
        f"the world mesh {names} = {dims} leaves ranks {size}-{world_size - 1} out; they fail in "
        "get_dp_process_group",
        upstream="IndexError" if whole else "RuntimeError",
    )


def build_expert_parallel_mesh(world_size: int, degree: int) -> DeviceMesh:
    with reference_rules():
        dims = olmo_core.expert_dims(world_size, degree)
    return mesh([size for _, size in dims], [name for name, _ in dims])


# -- OLMo's getters, on the live mesh ------------------------------------------------------------
def _flatten_dims(
    root: DeviceMesh, *dims: str, name: str, names: Names
) -> tuple[DeviceMesh, Names]:
    """OLMo's ``_flatten_dims``: flatten on the root, rename, check the root knows the names."""
    new_names = olmo_core.flattened_names(names, dims, name)
    torch_private.flatten(root[dims], name)
    try:
        root[new_names]
    except KeyError as exc:
        raise RuntimeError(
            f"Flattening failed: root device mesh does not recognize {new_names}"
        ) from exc
    return root, new_names


def _fold_ep(root: DeviceMesh, names: Names) -> tuple[DeviceMesh, Names]:
    if "dp" in names and "ep" in names:
        return _flatten_dims(root, "dp", "ep", name="dp_ep", names=names)
    if "ep_replicate" in names and "ep_shard" in names:
        return _flatten_dims(root, "ep_replicate", "ep_shard", name="dp", names=names)
    return root, names


def _get_model_mesh(root: DeviceMesh) -> tuple[DeviceMesh, Names]:
    root, names = _fold_ep(root, tuple(root.mesh_dim_names or ()))
    if "cp" in names:
        last_dp = names[names.index("cp") - 1]
        if not last_dp.startswith("dp"):
            raise AssertionError(f"cp follows {last_dp!r}, not a dp dim")
        root, names = _flatten_dims(root, last_dp, "cp", name="dp_cp", names=names)
    return root, names


def _dp_names(names: Names) -> Names:
    return tuple(n for n in names if n.startswith("dp"))


def get_dp_model_mesh(root: DeviceMesh) -> DeviceMesh:
    root, names = _get_model_mesh(root)
    return root[_dp_names(names)]


def get_dp_mesh(root: DeviceMesh) -> DeviceMesh:
    root, names = _fold_ep(root, tuple(root.mesh_dim_names or ()))
    if "dp_cp" in names:
        raise RuntimeError("'get_dp_mesh' should be called on the original world mesh")
    return root[_dp_names(names)]


def get_dp_process_group(root: DeviceMesh) -> Any:
    dp_mesh = get_dp_mesh(root)
    if dp_mesh.ndim > 1:
        return torch_private.flatten(dp_mesh, "dp").get_group()
    return dp_mesh.get_group()


def _model_dim(dim: str, what: str) -> Callable[[DeviceMesh], DeviceMesh]:
    def getter(root: DeviceMesh) -> DeviceMesh:
        root, names = _get_model_mesh(root)
        if dim not in names:
            raise RuntimeError(
                f"could not determine {what} sub-mesh from mesh with dimensions {names}"
            )
        return root[dim]

    return getter


def _root_dim(dims: Names, what: str) -> Callable[[DeviceMesh], DeviceMesh]:
    def getter(root: DeviceMesh) -> DeviceMesh:
        names = tuple(root.mesh_dim_names or ())
        for dim in dims:
            if dim in names:
                return root[dim]
        raise RuntimeError(f"could not determine {what} sub-mesh from mesh with dimensions {names}")

    return getter


def get_pp_stage_mesh(root: DeviceMesh) -> DeviceMesh:
    pp_mesh = _root_dim(("pp",), "pipeline parallel")(root)
    pp_names = set(pp_mesh.mesh_dim_names or ())
    return root[tuple(n for n in root.mesh_dim_names or () if n not in pp_names)]


GETTERS: dict[str, Callable[[DeviceMesh], Any]] = {
    "get_dp_mesh": get_dp_mesh,
    "get_dp_process_group": get_dp_process_group,
    "get_dp_model_mesh": get_dp_model_mesh,
    "get_tp_mesh": _model_dim("tp", "tensor parallel"),
    "get_cp_mesh": _root_dim(("cp",), "context parallel"),
    "get_pp_mesh": _root_dim(("pp",), "pipeline parallel"),
    "get_pp_stage_mesh": get_pp_stage_mesh,
    "get_ep_mesh": _root_dim(("ep", "ep_shard", "dp_shard"), "expert parallel"),
    "get_dp_shard_mesh": _model_dim("dp_shard", "data parallel shard"),
    "get_dp_replicate_mesh": _model_dim("dp_replicate", "data parallel replicate"),
}


def _mesh_entries(root: DeviceMesh, prefix: str) -> dict[str, Entry]:
    """Root dims, then every getter's result (or its error), then what the getters flattened."""
    entries: dict[str, Entry] = {dim: root[dim] for dim in root.mesh_dim_names or ()}
    for name, getter in GETTERS.items():
        try:
            entries[prefix + name] = getter(root)
        except (RuntimeError, KeyError, ValueError) as error:
            entries[prefix + name] = error
    for alias, flat in torch_private.flatten_mapping(root).items():
        entries[prefix + alias] = flat
    return entries
