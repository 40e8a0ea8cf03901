"""PyTorch DeviceMesh: ``init_device_mesh`` followed by ``_flatten`` / ``_unflatten`` operations.

Operations are strings (the CLI's form) or tuples:

* ``"flatten dp,cp"`` or ``"flatten dp,cp -> dp_cp"`` / ``("flatten", ("dp", "cp"), "dp_cp")``
* ``"unflatten world 2,4 -> dp,tp"`` / ``("unflatten", "world", (2, 4), ("dp", "tp"))``
* ``"unflatten 0 2,4 -> dp,tp"``: the root's dim by index (torch 2.10 and 2.11 refuse a name)

An unflatten makes a new view (torch returns a new mesh whose names the old root does not see);
later operations act on the first view holding all the dims they name, the way torchtitan looks
meshes up. Every dim of every view and every flattened name becomes a kind.

Roles come from the dim names, by naming family (the table is on the torch convention page,
:data:`ROLE_FAMILIES` here; the rules in :mod:`meshsim.model.conventions._torch_roles`):
``tensor``, ``context``, ``pipeline`` and ``expert`` are the ``tp``, ``cp``, ``pp`` and ``ep``
dims; ``data_parallel`` is the product of the data dims (``dp``, ``dp_replicate``, ``dp_shard``,
``batch``, ...) and ``gradient_reduce`` (and ``loss``) the product of the data and context dims,
since FSDP and HSDP reduce over cp too. A product the mesh never flattened is a kind of its own,
``dp_replicate×dp_shard``, marked derived (``Expected.derived_kinds``): no process group has
its groups, so verify and the builders do not expect to observe it. Dim names outside every
family (``dim0``, ``world``) leave the two roles unknown (``Expected.unknown_roles``): the
data-flow checks then refuse and ask for
``roles={"data_parallel": ..., "gradient_reduce": ...}``, each a dim, a flattened dim, dims to
multiply (``"dp_replicate,dp_shard"``) or None for none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import _torch_backend, _torch_roles, reject_unknown
from meshsim.model.expected import ROLES, Expected, Kind, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations, spread

PARAMETERS: Final[Mapping[str, str]] = {
    "mesh_shape": "sizes of the mesh dims, outermost first (default: (world_size,))",
    "mesh_dim_names": "names of the mesh dims (default: dim0, dim1, ... or ('world',) for 1-D)",
    "mesh": "an explicit rank tensor (nested lists) instead of mesh_shape",
    "ops": "flatten/unflatten operations, e.g. ['flatten dp,cp -> dp_cp']",
    "roles": "role -> kind overrides, e.g. {'tensor': 'tp', 'data_parallel': 'dp_replicate,"
    "dp_shard'}: a dim, a flattened dim, dims to multiply or None (none)",
    "backend_override": "init_device_mesh's per-dim backend, e.g. {'tp': 'fake', 0: 'gloo'}",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "roles": "names the kind each role reads; no group depends on it",
}

#: ``DeviceMesh.get_local_rank()`` / ``get_group()`` with no ``mesh_dim``, on the root mesh.
LOCAL_RANK_KIND: Final = "get_local_rank"
_LOCAL_RANK_DESCRIPTION: Final = "get_local_rank() / get_group(), no mesh_dim: 1-D root only"

#: The naming families the roles are read by, each as (family, who names dims so, a world-8
#: config of it): the torch convention page shows each with the roles meshsim reads from it.
ROLE_FAMILIES: Final[tuple[tuple[str, str, Mapping[str, Any]], ...]] = (
    (
        "HSDP replicate x shard",
        "FSDP2 users, OLMo-core (dp=hsdp), accelerate",
        {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp_replicate", "dp_shard", "tp")},
    ),
    (
        "HSDP with context parallel",
        "OLMo-core (dp=hsdp, cp), accelerate (dp_shard_cp), torchtitan's dense view",
        {
            "mesh_shape": (2, 2, 2),
            "mesh_dim_names": ("dp_replicate", "dp_shard", "cp"),
            "ops": ["flatten dp_shard,cp -> dp_shard_cp"],
        },
    ),
    (
        "one data dim, flattened with cp",
        "OLMo-core (dp=fsdp/ddp: dp, dp_cp), torchtitan legacy (dp, dp_cp)",
        {
            "mesh_shape": (2, 2, 2),
            "mesh_dim_names": ("dp", "cp", "tp"),
            "ops": ["flatten dp,cp -> dp_cp"],
        },
    ),
    (
        "torchtitan views",
        "torchtitan's build_mesh: (pp, batch, cp, tp), loss = batch x cp, (dp_replicate, fsdp) "
        "with fsdp = dp_shard x cp",
        {
            "ops": [
                "unflatten world 2,2,2 -> batch,cp,tp",
                "flatten batch,cp -> loss",
                "unflatten world 2,2,2 -> dp_replicate,fsdp,tp",
            ]
        },
    ),
    (
        "replicate x fsdp",
        "transformers (pp, dp_replicate, fsdp, tp)",
        {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp_replicate", "fsdp", "tp")},
    ),
    (
        "Lightning",
        "ModelParallelStrategy's (data_parallel, tensor_parallel)",
        {"mesh_shape": (4, 2), "mesh_dim_names": ("data_parallel", "tensor_parallel")},
    ),
    (
        "none: names outside every family",
        "init_device_mesh without mesh_dim_names (dim0, dim1, ...), a 1-D 'world'",
        {"mesh_shape": (4, 2)},
    ),
)


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

    roles, unknown = _roles(views, kinds, dict(config.get("roles", {})))
    normal = {
        "mesh_shape": root.shape,
        "mesh_dim_names": root.dim_names,
        "ops": tuple(config.get("ops", ())),
    }
    if override is not None:
        normal["backend_override"] = override
    return Expected(
        "torch",
        world_size,
        normal,
        kinds.values(),
        roles,
        layout=views[-1].root(),
        unknown_roles=unknown,
    )


def _roles(
    views: list[Layout], kinds: dict[str, Kind], given: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, str]]:
    """(role -> kind, role -> why it is unknown): the names' roles, then ``given`` over them;
    ``loss`` follows ``gradient_reduce`` unless given. Product kinds join ``kinds``."""
    inferred = _torch_roles.infer(views, kinds)
    roles, unknown = inferred.roles, inferred.unknown
    kinds.update(inferred.derived)
    for role, value in given.items():
        if role not in ROLES:
            raise LayoutError(f"unknown role {role!r}; roles are {list(ROLES)}")
        unknown.pop(role, None)
        if value is None:
            roles.pop(role, None)
        else:
            roles[role] = _given_kind(role, value, views, kinds)
    if "loss" not in given:
        roles.pop("loss", None)
        if "gradient_reduce" in roles:
            roles["loss"] = roles["gradient_reduce"]
    names = tuple(dict.fromkeys(d for view in views for d in view.dim_names))
    hint = (
        "pass roles={'data_parallel': ..., 'gradient_reduce': ...} to meshsim.expect('torch', "
        "...) or @pytest.mark.meshsim_layout('torch', ...): each a dim, a flattened dim, dims to "
        "multiply ('a,b') or None for none"
    )
    if "gradient_reduce" in unknown and "loss" not in given:
        unknown["loss"] = unknown["gradient_reduce"]
    messages = {
        role: f"the torch convention cannot tell the {role} role of mesh dims {names}: {why}; "
        + hint
        for role, why in unknown.items()
    }
    return roles, messages


def _given_kind(role: str, value: Any, views: list[Layout], kinds: dict[str, Kind]) -> str:
    """The kind ``roles={role: value}`` names: a kind, or a product of dims of one view
    (``"a,b"`` or ``("a", "b")``), made a kind of its own when the mesh never flattened it."""
    if isinstance(value, str) and value in kinds:
        return value
    dims = tuple(d.strip() for d in value.split(",")) if isinstance(value, str) else tuple(value)
    if len(dims) < 2 or not all(isinstance(d, str) and d for d in dims):
        raise LayoutError(f"role {role!r} maps to unknown kind {value!r}; kinds: {list(kinds)}")
    for view in views:
        if set(dims) <= set(view.dim_names):
            ordered = [d for d in view.dim_names if d in dims]
            if len(ordered) != len(dims):
                break
            return _torch_roles.product_kind(view, ordered, kinds, kinds)
    raise LayoutError(
        f"role {role!r} multiplies dims {dims} that no mesh view holds together; views: "
        f"{[v.dim_names for v in views]}"
    )


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
            dim = int(words[1]) if words[1].isdigit() else words[1]
            return ("unflatten", (dim, sizes, target_names))
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
    if verb == "unflatten" and isinstance(args[0], int):
        # A dim given by index is the root mesh's (``root._unflatten(0, ...)``), the spelling
        # torch 2.10 and 2.11 need.
        _torch_release.require_unflatten(f"unflatten {args[0]!r}")
        views.append(views[0].unflatten(*args))
        return
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


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (pp, dp, cp, tp) mesh of ``world_size`` with dp and cp flattened into ``dp_cp``;
    then, over a few of those shapes (:func:`~meshsim.model.sweep.spread`), the other ways to
    make the same dims: an explicit ``mesh`` tensor holding the ranks first dim fastest
    (``DeviceMesh(mesh=...)``, nothing flattened), the dims unflattened from a 1-D world
    (``_unflatten``), and the innermost dim of size > 1 on the ``fake`` backend
    (``backend_override``); each only where the described torch release builds it. World 8
    gives 29 configs.

    ``mesh_dim_names=`` enumerates ``init_device_mesh`` meshes of those dims instead: every
    shape, and the ``backend_override`` ones (no rank tensor, no unflattened view)."""
    names = tuple(options.get("mesh_dim_names", ("pp", "dp", "cp", "tp")))
    other_ways = "mesh_dim_names" not in options
    ops = ["flatten dp,cp -> dp_cp"] if {"dp", "cp"} <= set(names) else []
    listed: list[dict[str, Any]] = []
    for shape in ordered_factorizations(world_size, len(names)):
        assert math.prod(shape) == world_size
        listed.append({"mesh_shape": shape, "mesh_dim_names": names, "ops": ops})
    yield from listed
    picked = spread(listed, names, lambda c: dict(zip(names, c["mesh_shape"])))
    candidates: list[dict[str, Any]] = []
    for config in picked if other_ways else []:
        # No flatten: torch's new_group sorts a group's ranks, and a flattened dim of this
        # tensor is not ascending (the reference keeps the tensor's order; a known gap).
        candidates.append({"mesh": _first_fastest(config["mesh_shape"]), "mesh_dim_names": names})
    # torch 2.10 and 2.11 refuse a dim given by name; programs there pass its index.
    world = 0 if _torch_release.target() in _torch_release.UNFLATTEN_BY_NAME_BROKEN else "world"
    for config in picked if other_ways else []:
        sizes = ",".join(map(str, config["mesh_shape"]))
        unflatten = f"unflatten {world} {sizes} -> {','.join(names)}"
        candidates.append({"mesh_shape": (world_size,), "ops": [unflatten, *ops]})
    for config in picked:
        inner = [n for n, size in zip(names, config["mesh_shape"]) if size > 1][-1:]
        if inner:
            candidates.append({**config, "backend_override": {inner[0]: "fake"}})
    for config in candidates:
        try:
            expect(world_size, **config)
        except LayoutError:
            continue  # the described torch release lacks what it needs
        yield config


def _first_fastest(shape: Sequence[int]) -> list[Any]:
    """The rank tensor of ``shape`` numbered first dim fastest, as nested lists: (2, 4) gives
    ``[[0, 2, 4, 6], [1, 3, 5, 7]]``."""
    strides = [math.prod(shape[:i]) for i in range(len(shape))]

    def block(dim: int, base: int) -> Any:
        if dim == len(shape):
            return base
        return [block(dim + 1, base + i * strides[dim]) for i in range(shape[dim])]

    return block(0, 0)  # type: ignore[no-any-return]


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
