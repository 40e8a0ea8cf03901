"""Every mesh torchtitan 0.3.0's ``ParallelDims`` hands its users, as kinds of the current version.

``build_mesh`` keeps every axis, size 1 included, in its views: axes torchtitan counts as off
(degree 1, ``efsdp`` without EP) get the ``fake`` backend instead of being dropped. So the same
axis answers three ways: ``get_mesh(x)`` raises, ``get_optional_mesh(x)`` returns None and
``get_optional_mesh(x, include_singleton_axes=True)`` returns the (fake-backed) mesh. Each
answer is its own kind, named by the call that produces it, so a check can hold a framework to
each. A ``None`` answer is a kind with no groups (no rank holds one); a raise is an unavailable
kind carrying torchtitan's exception type. Kinds of the 0.3.0 public API:

* ``world_mesh``: the 1-D ``world`` mesh every view is unflattened from;
* per axis name (every name any backend registers, plus ``world``, which no backend accepts):
  ``<axis>`` (``get_mesh``), ``get_optional_mesh(<axis>)`` and
  ``get_optional_mesh(<axis>, include_singleton_axes=True)``;
* per multi-axis request (every in-order selection of two or more dims of a global view, plus
  requests torchtitan refuses): the same three calls with a list;
* ``<view>[<dim>]``: each dim of each global view (``dataloading``, ``loss``, ``dense``,
  ``sparse``, ``spmd_dense_for_fwdbwd``, ``spmd_sparse_for_fwdbwd``), KeyError where the view
  or the dim does not exist under the backend;
* ``spmd_meshes()[i]`` and ``spmd_meshes()[i][<axis>]``, ``spmd_dense_mesh()``,
  ``spmd_sparse_mesh()`` and ``get_dense_tp_mesh()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any, Final, Protocol

from meshsim.errors import LayoutError
from meshsim.model.expected import Kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout


class _Views(Protocol):
    """What the getters read of the reference's views (``torchtitan._Views``), declared here
    so that this module needs nothing of the reference (which imports it)."""

    @property
    def version(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def world(self) -> Layout: ...
    @property
    def single(self) -> dict[str, Layout]: ...
    @property
    def global_meshes(self) -> dict[str, Layout]: ...
    @property
    def memo(self) -> dict[Any, Any]: ...
    def exists(self, axis: str) -> bool: ...
    def backends(self, mesh: Layout) -> tuple[str | None, ...]: ...


SINGLETONS: Final = "include_singleton_axes=True"
#: Every single-axis name some 0.3.0 backend registers, in registration order, then ``world``
#: (the world mesh's dim, which ``get_mesh`` does not accept).
AXES: Final = (
    "pp", "batch", "loss", "dp_replicate", "cp", "tp", "ep", "efsdp", "dp", "dp_shard", "fsdp",
    "world",
)  # fmt: skip
#: Every dim each global view can have under some backend, in view order.
VIEW_DIMS: Final[Mapping[str, tuple[str, ...]]] = {
    "dataloading": ("pp", "batch", "cp", "tp"),
    "loss": ("loss_mesh",),
    "dense": ("pp", "dp_replicate", "dp_shard", "fsdp", "cp", "tp"),
    "sparse": ("pp", "dp_replicate", "efsdp", "ep"),
    "spmd_dense_for_fwdbwd": ("dp", "cp", "tp"),
    "spmd_sparse_for_fwdbwd": ("dp_replicate", "efsdp", "ep"),
}
#: ``build_mesh``'s ``_single_axis_meshes`` that every backend registers: axis -> the global
#: view it is sliced from and its dim there (None: the whole 1-D view). ``etp``, ``dp`` and
#: ``fsdp`` or ``dp_shard`` follow, by version and backend.
SINGLE_AXIS_VIEWS: Final[Mapping[str, tuple[str, str | None]]] = {
    "pp": ("dataloading", "pp"),
    "batch": ("dataloading", "batch"),
    "loss": ("loss", None),
    "dp_replicate": ("dense", "dp_replicate"),
    "cp": ("dataloading", "cp"),
    "tp": ("dataloading", "tp"),
    "ep": ("sparse", "ep"),
    "efsdp": ("sparse", "efsdp"),
}


def single_axis_meshes(views: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`SINGLE_AXIS_VIEWS` sliced from ``views`` (Layouts here, live DeviceMeshes in
    the builder): one statement of where each axis comes from."""
    return {
        axis: views[view] if dim is None else views[view][dim]
        for axis, (view, dim) in SINGLE_AXIS_VIEWS.items()
    }


#: ``build_mesh``'s candidate SPMD axes, dense per backend, then sparse.
DENSE_SPMD_AXES: Final[Mapping[str, tuple[str, ...]]] = {
    "spmd_types": ("dp", "cp", "tp"),
    "full_dtensor": ("dp_replicate", "dp_shard", "cp", "tp"),
    "partial_dtensor": ("dp_replicate", "fsdp", "tp"),
}
SPARSE_SPMD_AXES: Final = ("dp_replicate", "efsdp", "ep")
#: The getters that hand out a whole view (not one axis or dim of it).
VIEW_GETTERS: Final = (
    "spmd_meshes()[0]", "spmd_meshes()[1]", "spmd_dense_mesh()", "spmd_sparse_mesh()",
    "get_dense_tp_mesh()",
)  # fmt: skip
SPMD_AXES: Final = ("dp_replicate", "dp", "dp_shard", "fsdp", "cp", "tp", "efsdp", "ep")
_NO_GROUPS: Final = Groups([])


def not_available(dims: str | Sequence[str]) -> LayoutError:
    """``get_mesh``'s ValueError for an axis that is off (size 1, or fake-backed)."""
    shown = dims if isinstance(dims, str) else list(dims)
    enabled = "enabled (size > 1)" if isinstance(dims, str) else "all enabled"
    return LayoutError(
        f"Mesh '{shown}' is not available. Ensure the corresponding parallelism dimension is "
        f"{enabled}.",
        upstream="ValueError",
    )


def request(views: _Views, dims: str | Sequence[str], *, singletons: bool) -> Layout | None:
    """``get_optional_mesh(dims, include_singleton_axes=singletons)``.

    Names are checked first (ValueError), then, without ``singletons``, any axis that is off
    gives None; a multi-axis request is sliced from the first global view holding every name,
    in the order asked (torch's KeyError when that order is not the view's).
    """
    names = [dims] if isinstance(dims, str) else list(dims)
    for name in names:
        if name not in views.single:
            raise LayoutError(
                f"Invalid mesh dim: '{name}'. Valid dimensions are: {list(views.single)}",
                upstream="ValueError",
            )
    if not singletons and not all(views.exists(name) for name in names):
        return None
    if len(names) == 1:
        return views.single[names[0]]
    key = tuple(names)
    if key not in views.memo:  # get_mesh and both get_optional_mesh forms share one slice
        views.memo[key] = _slice(views, key)
    answer = views.memo[key]
    if isinstance(answer, LayoutError):
        raise answer
    return answer


def _slice(views: _Views, names: tuple[str, ...]) -> Layout | LayoutError:
    for mesh in views.global_meshes.values():
        if set(names) <= set(mesh.dim_names):
            try:
                return mesh[names]
            except LayoutError as error:
                return error
    return LayoutError(f"Invalid mesh name combinations {list(names)}.", upstream="ValueError")


def get_mesh(views: _Views, dims: str | Sequence[str]) -> Layout:
    mesh = request(views, dims, singletons=False)
    if mesh is None:
        raise not_available(dims)
    return mesh


def spmd_meshes(views: _Views) -> list[Layout]:
    """``spmd_meshes()``: the dense and sparse SPMD meshes restricted to enabled axes."""
    if "spmd_meshes()" in views.memo:
        return list(views.memo["spmd_meshes()"])
    out = []
    for axes in (DENSE_SPMD_AXES[views.backend], SPARSE_SPMD_AXES):
        active = [a for a in axes if a in views.single and views.exists(a)]
        if active:
            mesh = request(views, active, singletons=False)
            assert mesh is not None  # every axis is enabled
            out.append(mesh)
    views.memo["spmd_meshes()"] = tuple(out)
    return out


def dense_tp_mesh(views: _Views) -> Layout:
    """``get_dense_tp_mesh()``: tp of the fwd/bwd view (spmd_types), of the first SPMD mesh
    (full_dtensor; KeyError when tp is off), or ``get_mesh("tp")`` (partial_dtensor)."""
    if views.backend == "spmd_types":
        return views.global_meshes["spmd_dense_for_fwdbwd"]["tp"]
    if views.backend == "full_dtensor":
        return _index(spmd_meshes(views), 0)["tp"]
    return get_mesh(views, "tp")


def multi_axis_requests(views: _Views) -> list[tuple[str, ...]]:
    """Every in-order selection of >= 2 dims of each global view (names ``get_mesh`` takes),
    then requests torchtitan refuses: each view's dims reversed, and two combinations no view
    holds."""
    wanted: dict[tuple[str, ...], None] = {}
    reverse: dict[tuple[str, ...], None] = {}
    for view in views.global_meshes.values():
        dims = [d for d in view.dim_names if d in views.single]
        for count in range(2, len(dims) + 1):
            wanted.update(dict.fromkeys(combinations(dims, count)))
        if len(dims) > 1:
            reverse[tuple(reversed(dims))] = None
    refused = [r for r in reverse if r not in wanted] + [("loss", "tp"), ("batch", "dp_replicate")]
    return [*wanted, *refused]


def call_name(method: str, dims: str | Sequence[str], singletons: bool = False) -> str:
    """The kind name of one getter call: ``get_mesh([dp_replicate, dp_shard])``."""
    shown = dims if isinstance(dims, str) else f"[{', '.join(dims)}]"
    return f"{method}({shown}{', ' + SINGLETONS if singletons else ''})"


Answer = Layout | None | LayoutError


def api_kinds(views: _Views, answers: dict[str, Answer] | None = None) -> dict[str, Kind]:
    """Kinds for every getter call above (the single-axis ``get_mesh`` kinds come from
    :meth:`_Views.kinds`; those of axes the backend lacks are added here). ``answers``, when
    given, gets each call's answer by kind name: its mesh, None, or its error."""
    kinds: dict[str, Kind] = {}

    def add(name: str, description: str, call: Callable[[], Layout | None]) -> None:
        try:
            answer: Answer = call()
        except LayoutError as error:
            answer = error
        if answers is not None:
            answers[name] = answer
        kinds[name] = answer_kind(views, name, description, answer)

    add("world_mesh", "world_mesh: the 1-D world mesh every view unflattens", lambda: views.world)
    for axis in AXES:
        if axis not in views.single:
            add(axis, f"get_mesh('{axis}'): no such axis", lambda a=axis: get_mesh(views, a))
    for axis in AXES:
        add(
            call_name("get_optional_mesh", axis),
            f"get_mesh('{axis}'), or None where the axis is off (size 1, fake-backed)",
            lambda a=axis: request(views, a, singletons=False),
        )
        add(
            call_name("get_optional_mesh", axis, True),
            f"the '{axis}' mesh even where it is off (size 1, fake backend)",
            lambda a=axis: request(views, a, singletons=True),
        )
    for dims in multi_axis_requests(views):
        source = next(
            (f"sliced from the '{n}' view" for n, v in views.global_meshes.items()
             if set(dims) <= set(v.dim_names)),
            "no view holds them all",
        )  # fmt: skip
        add(call_name("get_mesh", dims), f"{source}; ValueError if an axis is off",
            lambda d=dims: get_mesh(views, d))  # fmt: skip
        add(call_name("get_optional_mesh", dims), f"{source}; None if an axis is off",
            lambda d=dims: request(views, d, singletons=False))  # fmt: skip
        add(call_name("get_optional_mesh", dims, True), f"{source}; size-1 axes kept",
            lambda d=dims: request(views, d, singletons=True))  # fmt: skip
    for view_name, dims in VIEW_DIMS.items():
        for dim in dims:
            add(
                f"{view_name}[{dim}]",
                f"dim '{dim}' of the '{view_name}' global view",
                lambda v=view_name, d=dim: _view(views, v)[d],
            )
    for index in (0, 1):
        label = f"spmd_meshes()[{index}]"
        add(label, f"{label}: {('dense', 'sparse')[index]} SPMD mesh, enabled axes only",
            lambda i=index: _index(spmd_meshes(views), i))  # fmt: skip
        for axis in SPMD_AXES:
            add(
                f"{label}[{axis}]",
                f"{label}['{axis}']",
                lambda i=index, a=axis: _index(spmd_meshes(views), i)[a],
            )
    add(
        "spmd_dense_mesh()",
        "spmd_dense_mesh(): the (dp, cp, tp) fwd/bwd view (spmd_types only)",
        lambda: _view(views, "spmd_dense_for_fwdbwd"),
    )
    add(
        "spmd_sparse_mesh()",
        "spmd_sparse_mesh(): the (dp_replicate, efsdp, ep) fwd/bwd view, or None",
        lambda: views.global_meshes.get("spmd_sparse_for_fwdbwd"),
    )
    add(
        "get_dense_tp_mesh()",
        "get_dense_tp_mesh(): TP mesh of the dense fwd/bwd",
        lambda: dense_tp_mesh(views),
    )
    return kinds


def _view(views: _Views, name: str) -> Layout:
    if name not in views.global_meshes:
        raise LayoutError(f"'{name}'", upstream="KeyError")
    return views.global_meshes[name]


def _index(meshes: list[Layout], index: int) -> Layout:
    if index >= len(meshes):
        raise LayoutError("list index out of range", upstream="IndexError")
    return meshes[index]


def answer_kind(views: _Views, name: str, description: str, answer: Answer) -> Kind:
    """The kind of one call's answer: its groups, no groups (None) or its error."""
    if isinstance(answer, LayoutError):
        return Kind(name, description, answer)
    mesh = answer
    if mesh is None:
        return Kind(name, description, _NO_GROUPS, partition=False)
    return Kind(
        name,
        description,
        mesh.groups,
        mesh_dims=mesh.dim_names,
        mesh_shape=mesh.shape,
        backends=views.backends(mesh),
    )


def refused_configs(world_size: int) -> list[dict[str, object]]:
    """Current-version configs torchtitan 0.3.0 refuses at ``world_size``, one per way to fail.

    Every ordered factorization (pp, dp_replicate, dp_shard, cp, tp) with each divisor of the
    world as ``ep`` that does not divide dp_shard * cp * tp (torch's ``_unflatten`` ValueError),
    then degree errors (AssertionError): a degree of 0, a negative dp_shard, dp_shard=-1
    resolving to 0, a product that is not the world, and an unknown ``spmd_backend``
    (``ParallelismConfig``'s ValueError).
    """
    from meshsim.model.sweep import divisors, ordered_factorizations

    stray = next(d for d in range(2, world_size + 2) if world_size % d)
    out: list[dict[str, object]] = []
    for pp, dpr, dps, cp, tp in ordered_factorizations(world_size, 5):
        for ep in divisors(world_size):
            if (dps * cp * tp) % ep:
                out.append(dict(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, ep=ep))
    out += [
        {"tp": 0},
        {"ep": 0},
        {"dp_shard": -2},
        {"dp_shard": 0},
        {"tp": 2 * world_size},  # dp_shard=-1 resolves to 0
        {"tp": stray},  # dp_shard=-1 resolves to world // stray; the product is not the world
        {"dp_shard": world_size, "tp": 2},
        {"dp_shard": 2, "spmd_backend": "dtensor"},
    ]
    unique = {repr(config): config for config in out}  # world 1: tp=2*world is the stray tp
    return list(unique.values())
