"""PyTorch DeviceMesh: ``init_device_mesh`` followed by ``_flatten`` / ``_unflatten`` operations.

Operations are strings (the CLI's form) or tuples:

* ``"flatten dp,cp"`` or ``"flatten dp,cp -> dp_cp"`` / ``("flatten", ("dp", "cp"), "dp_cp")``
* ``"unflatten world 2,4 -> dp,tp"`` / ``("unflatten", "world", (2, 4), ("dp", "tp"))``

An unflatten makes a new view (torch returns a new mesh whose names the old root does not see);
later operations act on the first view holding all the dims they name, the way torchtitan looks
meshes up. Every dim of every view and every flattened name becomes a kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import _torch_backend, reject_unknown
from meshsim.model.expected import ROLES, Expected, Kind, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations

PARAMETERS: Final[Mapping[str, str]] = {
    "mesh_shape": "sizes of the mesh dims, outermost first (default: (world_size,))",
    "mesh_dim_names": "names of the mesh dims (default: dim0, dim1, ... or ('world',) for 1-D)",
    "mesh": "an explicit rank tensor (nested lists) instead of mesh_shape",
    "ops": "flatten/unflatten operations, e.g. ['flatten dp,cp -> dp_cp']",
    "roles": "role -> kind overrides, e.g. {'tensor': 'tp'}",
    "backend_override": "init_device_mesh's per-dim backend, e.g. {'tp': 'fake', 0: 'gloo'}",
}

#: ``DeviceMesh.get_local_rank()`` / ``get_group()`` with no ``mesh_dim``, on the root mesh.
LOCAL_RANK_KIND: Final = "get_local_rank"
_LOCAL_RANK_DESCRIPTION: Final = "get_local_rank() / get_group(), no mesh_dim: 1-D root only"

_ROLE_CANDIDATES: Final[Mapping[str, tuple[str, ...]]] = {
    "data_parallel": ("dp", "batch", "data", "dp_replicate_dp_shard", "dp_shard", "dp_replicate"),
    "gradient_reduce": ("dp_cp", "dp_shard_cp", "fsdp", "loss", "dp", "batch", "dp_shard"),
    "loss": ("loss", "dp_cp", "dp", "batch"),
    "tensor": ("tp",),
    "context": ("cp",),
    "pipeline": ("pp",),
    "expert": ("ep",),
}


def expect(world_size: int, **config: Any) -> Expected:
    reject_unknown("torch", config, PARAMETERS)
    root = _root_layout(world_size, config)
    override = _backend_override(root, config)
    views = [root]
    for op in config.get("ops", ()):
        _apply(views, _parse_op(op))

    # A root dim keeps its overridden backend in every slice; flattened and unflattened dims
    # get the world's (the ops take no override).
    backend_of = {name: b for name, (b, _) in zip(root.dim_names, override or ()) if b}
    kinds: dict[str, Kind] = {}
    for index, view in enumerate(views):  # views[0] is the root (with its flattened aliases)
        for dim in view.dim_names:
            backend = (backend_of.get(dim),) if index == 0 else ()
            description = f"mesh dim {dim!r} of {view!r}"
            _add(kinds, layout_kind(view, dim, description, dim, backends=backend))
        for alias, axes in view.aliases.items():
            _add(kinds, layout_kind(view, alias, f"_flatten of {axes} into {alias!r}", alias))
    _add(kinds, _local_rank_kind(root, backend_of))

    roles = {role: _pick(kinds, names) for role, names in _ROLE_CANDIDATES.items()}
    roles = {r: k for r, k in roles.items() if k is not None}
    for role, kind in dict(config.get("roles", {})).items():
        if role not in ROLES:
            raise LayoutError(f"unknown role {role!r}; roles are {list(ROLES)}")
        if kind not in kinds:
            raise LayoutError(f"role {role!r} maps to unknown kind {kind!r}; kinds: {list(kinds)}")
        roles[role] = kind
    normal = {
        "mesh_shape": root.shape,
        "mesh_dim_names": root.dim_names,
        "ops": tuple(config.get("ops", ())),
    }
    if override is not None:
        normal["backend_override"] = override
    return Expected("torch", world_size, normal, kinds.values(), roles, layout=views[-1].root())


def _local_rank_kind(root: Layout, backend_of: Mapping[str, str]) -> Kind:
    """torch answers only on a 1-D mesh; an N-D one raises rather than guess a dim."""
    if root.ndim == 1:
        dim = root.dim_names[0]
        backend = (backend_of.get(dim),)
        return layout_kind(root, LOCAL_RANK_KIND, _LOCAL_RANK_DESCRIPTION, dim, backends=backend)
    error = LayoutError(
        f"Found the DeviceMesh have {root.ndim} dimensions; Optional kwarg `mesh_dim` needs to "
        "be specified when device_mesh.ndim > 1.",
        upstream="RuntimeError",
    )
    return Kind(LOCAL_RANK_KIND, _LOCAL_RANK_DESCRIPTION, error)


def _backend_override(root: Layout, config: Mapping[str, Any]) -> tuple[Any, ...] | None:
    override = config.get("backend_override")
    if override is not None:
        _torch_release.require_backend_override()
    if override is not None and "mesh" in config:
        raise LayoutError(
            "backend_override is modelled for init_device_mesh (mesh_shape) only; "
            "DeviceMesh(mesh=...) takes a per-dim tuple instead"
        )
    return _torch_backend.normalize(override, root.ndim, root.dim_names)


def _root_layout(world_size: int, config: Mapping[str, Any]) -> Layout:
    if "mesh" in config:
        if "mesh_shape" in config:
            raise LayoutError("give either mesh or mesh_shape, not both")
        layout = Layout.from_mesh(config["mesh"], config.get("mesh_dim_names"))
        if layout.world_size > world_size or int(layout.mesh.max()) >= world_size:
            raise LayoutError(
                f"Mesh should not be bigger than default world size {world_size}, but found "
                f"{layout.world_size} ranks (max rank {int(layout.mesh.max())}).",
                upstream="RuntimeError",
            )
        return layout
    raw = config.get("mesh_shape", (world_size,))
    if isinstance(raw, int) or not hasattr(raw, "__iter__"):
        raise LayoutError(
            f"mesh_shape must be a tuple of dim sizes, got {raw!r} (a 1-D mesh is ({raw!r},))",
            upstream="TypeError",
        )
    shape = tuple(raw)
    names = config.get("mesh_dim_names")
    if names is None:
        names = ("world",) if len(shape) == 1 else tuple(f"dim{i}" for i in range(len(shape)))
    names = tuple(names)
    if len(shape) != len(names):
        raise LayoutError(
            f"mesh_shape and mesh_dim_names should have same length! Found {len(shape)} and "
            f"{len(names)}.",
            upstream="RuntimeError",
        )
    layout = Layout(list(zip(names, shape)))
    if layout.world_size > world_size:
        raise LayoutError(
            f"Mesh should not be bigger than default world size {world_size}, but found "
            f"{layout.world_size} ranks!",
            upstream="RuntimeError",
        )
    if layout.world_size != world_size:
        # init_device_mesh accepts a smaller mesh, but then ranks past it hold no group; meshsim
        # models the whole world, so say so rather than silently dropping ranks.
        raise LayoutError(
            f"mesh_shape {shape} covers {layout.world_size} ranks, not the world size "
            f"{world_size}; sizes must multiply to the world size"
        )
    return layout


Op = tuple[str, tuple[Any, ...]]


def _parse_op(op: str | Sequence[Any]) -> Op:
    if isinstance(op, str):
        head, _, target = op.partition("->")
        words = head.split()
        target_names = tuple(t.strip() for t in target.split(",") if t.strip())
        if words[:1] == ["flatten"] and len(words) == 2:
            dims = tuple(d for d in words[1].split(",") if d)
            return ("flatten", (dims, target_names[0] if target_names else None))
        if words[:1] == ["unflatten"] and len(words) == 3 and target_names:
            sizes = tuple(int(s) for s in words[2].split(","))
            return ("unflatten", (words[1], sizes, target_names))
        raise LayoutError(
            f"cannot parse op {op!r}; write 'flatten a,b -> name' or 'unflatten dim 2,4 -> a,b'"
        )
    verb, *rest = op
    if verb == "flatten":
        dims = (rest[0],) if isinstance(rest[0], str) else tuple(rest[0])
        return ("flatten", (dims, rest[1] if len(rest) > 1 else None))
    if verb == "unflatten" and len(rest) == 3:
        return ("unflatten", (rest[0], tuple(rest[1]), tuple(rest[2])))
    raise LayoutError(f"unknown op {op!r}; ops are flatten and unflatten")


def _apply(views: list[Layout], op: Op) -> None:
    verb, args = op
    wanted = args[0] if verb == "flatten" else (args[0],)
    for i, view in enumerate(views):
        known = set(view.dim_names) | set(view.aliases)
        if set(wanted) <= known:
            if verb == "flatten":
                if set(wanted) & set(view.aliases):
                    _torch_release.require_flatten_of_flattened(f"flatten {wanted}")
                views[i] = view[wanted].flatten(name=args[1]).root()
            else:
                _torch_release.require_unflatten(f"unflatten {args[0]!r}")
                _torch_release.require_unflatten_by_name(args[0], view.dim_names)
                views.append(view.unflatten(*args))
            return
    raise LayoutError(f"{verb} names dims {wanted} that no mesh view holds together")


def _add(kinds: dict[str, Kind], kind: Kind) -> None:
    if kind.name in kinds and kinds[kind.name].groups() != kind.groups():
        raise LayoutError(f"two views give the name {kind.name!r} to different groups")
    kinds.setdefault(kind.name, kind)


def _pick(kinds: Mapping[str, Kind], names: Sequence[str]) -> str | None:
    return next((n for n in names if n in kinds), None)


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (pp, dp, cp, tp) mesh of ``world_size`` with dp and cp flattened into ``dp_cp``."""
    names = tuple(options.get("mesh_dim_names", ("pp", "dp", "cp", "tp")))
    for shape in ordered_factorizations(world_size, len(names)):
        assert math.prod(shape) == world_size
        ops = ["flatten dp,cp -> dp_cp"] if {"dp", "cp"} <= set(names) else []
        yield {"mesh_shape": shape, "mesh_dim_names": names, "ops": ops}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs torch's ``init_device_mesh`` / ``_flatten`` / ``_unflatten`` reject, one per way.

    A mesh bigger than the world, an unknown ``backend_override`` dim, names and shape of
    different lengths and a repeated name (RuntimeError); a flatten out of dim order, both dims
    bigger than 1 (KeyError); a flatten named like a root dim and an unflatten whose sizes do
    not multiply to the dim's (ValueError).
    """
    two_d = {"mesh_shape": (1, world_size), "mesh_dim_names": ("dp", "tp")}
    yield {"mesh_shape": (2, world_size)}
    yield {"mesh_shape": (1, world_size), "mesh_dim_names": ("dp",)}
    yield {"mesh_shape": (1, world_size), "mesh_dim_names": ("dp", "dp")}
    yield {**two_d, "backend_override": {"pp": "gloo"}}
    yield {**two_d, "ops": ["flatten dp,tp -> dp"]}
    outer = divisors(world_size)[1] if world_size > 1 else 1
    if outer < world_size:  # torch lets a size-1 dim stand anywhere in a flatten
        shape = (outer, world_size // outer)
        yield {"mesh_shape": shape, "mesh_dim_names": ("dp", "tp"), "ops": ["flatten tp,dp"]}
    if _torch_release.builds_unflatten():  # below 2.10 torch has no _unflatten at all
        yield {"mesh_shape": (world_size,), "ops": [f"unflatten world 2,{world_size} -> a,b"]}
