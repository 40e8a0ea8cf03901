"""torchtitan ``ParallelDims``: current multi-view mesh, intermediate, legacy and hyper_parallel.

``version`` picks the code modelled (``torchtitan/distributed/parallel_dims.py``):

* ``"current"`` (default; since Dec 2025; what torchtitan 0.3.0 ships): a 1-D ``world`` mesh
  unflattened into views, each row-major with ``pp`` outermost: dataloading ``(pp, batch, cp,
  tp)``; ``loss`` = flatten(batch, cp); dense ``(pp, dp_replicate, dp_shard, cp, tp)`` plus
  ``(pp, dp, cp, tp)`` under ``spmd_backend="spmd_types"`` (default), the same dense view alone
  under ``"full_dtensor"``, or ``(pp, dp_replicate, fsdp, tp)`` under ``"partial_dtensor"``;
  sparse ``(pp, dp_replicate, efsdp, ep)`` (no ``etp``).
* ``"intermediate"`` (Dec 2025 - early 2026): sparse ``(pp, dp_replicate, efsdp, ep, etp)`` and a
  ``full_dtensor`` switch (``spmd_backend="partial_dtensor"`` default, or ``"full_dtensor"``).
* ``"legacy"`` and ``"hyper_parallel"``: one root mesh with flattened aliases
  (see ``_torchtitan_legacy``).

Kinds are the names torchtitan users pass to ``get_mesh``. An axis ``get_mesh`` refuses (degree 1,
fake-backed) is an *unavailable* kind holding torchtitan's ``ValueError("Mesh '<x>' is not
available ...")``; its groups are well defined on the fake backend, but no process group exists,
so a live check must not find one. ``get_all_one_dimensional_meshes`` and ``get_mesh`` (multi-axis
requests included) are mirrored by the functions of the same names here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import _torchtitan_api as api
from meshsim.model.conventions import _torchtitan_plan as api_plan
from meshsim.model.conventions import check, reject_unknown
from meshsim.model.conventions._torchtitan_legacy import (
    AXIS_ROLES,
    Degrees,
    hyper_parallel,
    legacy,
    pick_roles,
    validate_dense,
    validate_hyper,
    validate_legacy,
)
from meshsim.model.expected import Expected, Kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations, spread

PARAMETERS: Final[Mapping[str, str]] = {
    "dp_replicate": "data_parallel_replicate_degree (default 1)",
    "dp_shard": "data_parallel_shard_degree (default -1: the rest of the world)",
    "cp": "context_parallel_degree (default 1)",
    "tp": "tensor_parallel_degree (default 1)",
    "pp": "pipeline_parallel_degree (default 1)",
    "ep": "expert_parallel_degree (default 1)",
    "etp": "expert_tensor_parallel_degree: 1 or tp (intermediate, legacy, hyper_parallel)",
    "spmd_backend": "current: 'spmd_types' (default), 'partial_dtensor' or 'full_dtensor'; "
    "intermediate: 'partial_dtensor' (default) or 'full_dtensor'",
    "version": "'current' (default), 'intermediate', 'legacy' or 'hyper_parallel'",
    "ulysses_degree": "hyper_parallel only: Ulysses sub-degree of cp",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "ulysses_degree": "hyper_parallel only, where it is only checked against cp; no group "
    "depends on it",
}
VERSIONS: Final = ("current", "intermediate", "legacy", "hyper_parallel")
#: Versions whose ``build_mesh`` unflattens one world mesh into its views (torch >= 2.10).
_UNFLATTENING: Final = ("current", "intermediate")
#: The ``spmd_backend`` values of each multi-view version, its default first. torchtitan 0.3.0's
#: ``ParallelismConfig`` accepts exactly the current three (ValueError otherwise); the conventions
#: snapshot (b5bcd76c) lists only spmd_types and partial_dtensor, 0.3.0 also keeps full_dtensor.
_BACKENDS: Final[Mapping[str, tuple[str, ...]]] = {
    "current": ("spmd_types", "partial_dtensor", "full_dtensor"),
    "intermediate": ("partial_dtensor", "full_dtensor"),
}
_DESCRIPTIONS: Final[Mapping[str, str]] = {
    "pp": "pipeline parallel (PP)",
    "batch": "dp_replicate * dp_shard: data loading (no cp)",
    "loss": "flatten(batch, cp) ('loss_mesh'): loss and token-count all-reduce",
    "dp_replicate": "DDP / HSDP replicate axis of the dense view",
    "cp": "context parallel (CP)",
    "tp": "tensor parallel (TP)",
    "ep": "expert parallel: innermost axis of the sparse view",
    "efsdp": "FSDP axis of expert parameters in the sparse view",
    "etp": "expert tensor parallel: innermost axis of the sparse view",
    "dp": "dp_replicate * dp_shard: the SPMD forward/backward data axis",
    "dp_shard": "FSDP shard axis of the dense storage view",
    "fsdp": "dp_shard * cp: FSDP parameter-sharding axis",
}
_ROLES: Final[Mapping[str, str]] = {
    # ``batch`` is what the data loader asks for under both spmd backends (``dp`` has the same
    # groups under spmd_types). The full gradient-reduction domain is dp_replicate x dp_shard x
    # cp (FSDP shards over dp_shard x cp and replicates over dp_replicate), which is ``loss``.
    "data_parallel": "batch",
    "gradient_reduce": "loss",
    "loss": "loss",
    **AXIS_ROLES,
    "expert_data": "efsdp",
}


def expect(world_size: int, **config: Any) -> Expected:
    """Every group torchtitan's ``ParallelDims`` builds for ``config`` on ``world_size`` ranks.

    Example: ``expect(8, dp_shard=4, tp=2, ep=2).groups("ep")`` equals ``groups("tp")``:
    ``(0, 1)``, ``(2, 3)``, ``(4, 5)``, ``(6, 7)`` (ep is the innermost sparse axis).
    """
    reject_unknown("torchtitan", config, PARAMETERS)
    version, backend, raw, ulysses = _parse(config)
    degrees = _degrees(world_size, version, raw, ulysses)
    normal: dict[str, Any] = {"version": version}
    primary = None
    if version == "legacy":
        kinds, roles, layout = legacy(degrees)
    elif version == "hyper_parallel":
        kinds, roles, layout = hyper_parallel(degrees)
        if ulysses is not None:
            normal["ulysses_degree"] = ulysses
    else:
        assert backend is not None  # _parse gives every multi-view version its default
        views = _views(version, backend, degrees)
        _torch_release.require_unflatten(f"torchtitan {version!r} build_mesh")
        degrees = views.degrees
        kinds = views.kinds()
        if version == "current":
            # The world mesh, the axes and the view getters: the ~230 other getter calls and
            # view dims stay behind ``show --all-kinds``.
            primary = ["world_mesh", *views.single, *api.VIEW_GETTERS]
            kinds.update(api_plan.api_kinds(views))
        roles = pick_roles(kinds, _ROLES)
        layout = views.global_meshes["dense"].root()
        normal["spmd_backend"] = backend
    normal.update({k: v for k, v in asdict(degrees).items() if k != "world_size"})
    if version == "current":
        del normal["etp"]
    return Expected(
        "torchtitan", world_size, normal, kinds.values(), roles, layout=layout, primary=primary
    )


def validate(world_size: int, config: Mapping[str, Any]) -> tuple[str, str | None, Degrees]:
    """torchtitan's checks of ``config`` for its version, in its order: the version, the SPMD
    backend (None for legacy and hyper_parallel) and the validated degrees, ``dp_shard``
    resolved. Example: world 8, ``tp=2`` gives ``("current", "spmd_types", ...)`` with
    ``dp_shard`` 4."""
    version, backend, raw, ulysses = _parse(config)
    return version, backend, _degrees(world_size, version, raw, ulysses)


def _degrees(world_size: int, version: str, raw: Mapping[str, int], ulysses: int | None) -> Degrees:
    if version == "legacy":
        d = validate_dense(world_size, raw, with_etp=True)
        validate_legacy(d)
        return d
    if version == "hyper_parallel":
        return validate_hyper(world_size, raw, ulysses)
    d = validate_dense(world_size, raw, with_etp=version != "current")
    if version == "current":
        _check_ep_divides(d)
    else:
        check(d.ep == 1 or d.etp in (1, d.tp), "Currently we only support ETP=TP or ETP=1")
    return d


def _parse(config: Mapping[str, Any]) -> tuple[str, str | None, dict[str, int], int | None]:
    version = config.get("version", "current")
    if version not in VERSIONS:
        raise LayoutError(f"unknown torchtitan version {version!r}; versions are {VERSIONS}")
    allowed = _BACKENDS.get(version, ())
    backend = config.get("spmd_backend")
    if backend is None:
        backend = allowed[0] if allowed else None
    elif backend not in allowed:
        raise LayoutError(
            f"spmd_backend {backend!r} does not exist in torchtitan version {version!r}; "
            f"choose from {allowed or 'nothing (leave it out)'}"
            + (" (0.3.0's ParallelismConfig raises ValueError)" if version == "current" else ""),
            upstream="ValueError" if version == "current" else None,
        )
    raw: dict[str, int] = {}
    for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp"):
        value = config.get(key, -1 if key == "dp_shard" else 1)
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{key} must be an integer degree, got {value!r}")
        raw[key] = value
    if version == "current" and raw["etp"] != 1:
        raise LayoutError(
            f"the current torchtitan ParallelDims has no etp (expert TP left with the "
            f"intermediate sparse view); got etp={raw['etp']}. Use version='intermediate' or "
            f"'legacy', or leave etp out"
        )
    ulysses = config.get("ulysses_degree")
    if ulysses is not None and (version != "hyper_parallel" or not isinstance(ulysses, int)):
        raise LayoutError(
            f"ulysses_degree is an integer option of version='hyper_parallel' only; got "
            f"{ulysses!r} with version={version!r}"
        )
    if ulysses is not None and ulysses < 1:
        raise LayoutError(f"ulysses_degree must be >= 1, got {ulysses}")
    return version, backend, raw, ulysses


@dataclass(frozen=True)
class _Views:
    """The views one current/intermediate ``ParallelDims.build_mesh`` makes."""

    degrees: Degrees
    version: str
    backend: str
    world: Layout  # the 1-D ``world`` mesh every view is unflattened from
    single: dict[str, Layout]  # ``_single_axis_meshes``, in torchtitan's order
    global_meshes: dict[str, Layout]  # ``_global_meshes``: where multi-axis requests are sliced
    #: answers already computed (``exists`` per axis, slices per request): ~230 getters share them
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def exists(self, axis: str) -> bool:
        """``_mesh_exist``: is the axis backed by a real process group (not ``fake``)?"""
        if axis not in self.memo:
            self.memo[axis] = self.mesh_exist(axis, self.single[axis].size)
        return bool(self.memo[axis])

    def mesh_exist(self, name: str, degree: int) -> bool:
        """torchtitan's ``_mesh_exist(name, degree)``, asked of every dim it unflattens."""
        if name == "fsdp":
            return True  # fully_shard needs it, even at degree 1, for mixed precision
        if name == "dp_shard" and self.backend in self._storage_backends():
            return True
        if name == "efsdp":
            return self.degrees.ep > 1
        return degree > 1

    def backends(self, mesh: Layout) -> tuple[str | None, ...]:
        """The backend of each dim of a mesh sliced from the views: ``fake`` where
        ``build_mesh`` unflattened a dim it counts as off; the world's elsewhere (``world``
        and the flattened ``loss_mesh`` come from ``init_device_mesh`` and ``_flatten``,
        which take no override)."""
        key = ("backends", mesh.dim_names, mesh.shape)
        if key not in self.memo:
            self.memo[key] = tuple(
                None if dim in ("world", "loss_mesh") or self.mesh_exist(dim, size) else "fake"
                for dim, size in zip(mesh.dim_names, mesh.shape)
            )
        return self.memo[key]  # type: ignore[no-any-return]

    def _storage_backends(self) -> tuple[str, ...]:
        """Backends under which ``dp_shard`` is the dense storage axis, kept real at size 1.

        torchtitan 0.3.0 (current) keeps it under full_dtensor too (``spmd_backend in
        ("full_dtensor", "spmd_types")``); the conventions snapshot names spmd_types only, and
        0.3.0, the version users install, wins. The intermediate version is left as modelled.
        """
        return ("spmd_types", "full_dtensor") if self.version == "current" else ("spmd_types",)

    def kinds(self) -> dict[str, Kind]:
        kinds: dict[str, Kind] = {}
        for axis, view in self.single.items():
            if self.exists(axis):
                kinds[axis] = Kind(
                    axis,
                    _DESCRIPTIONS[axis],
                    view.groups,
                    mesh_dims=view.dim_names,
                    mesh_shape=view.shape,
                )
            else:
                kinds[axis] = Kind(axis, _DESCRIPTIONS[axis], api.not_available(axis))
        return kinds


def _check_ep_divides(d: Degrees) -> None:
    """The current version's EP rule: ep must divide dp_shard * cp * tp (the sparse region).

    Two upstream forms, both ValueError: the conventions snapshot (b5bcd76c) checks it in
    ``ParallelDims._validate``; torchtitan 0.3.0 has no check, so ``build_mesh`` computes
    ``efsdp = dp_shard * cp * tp // ep`` and torch's ``_unflatten`` of the sparse view refuses
    sizes whose product is not the world size.
    """
    region = d.dp_shard * d.cp * d.tp
    if region % d.ep == 0:
        return
    sizes = (d.pp, d.dp_replicate, region // d.ep, d.ep)
    raise LayoutError(
        f"expert_parallel_degree ({d.ep}) must divide dp_shard * cp * tp ({region}). torchtitan "
        f"0.3.0 does not check this itself: build_mesh unflattens the sparse view (pp, "
        f"dp_replicate, efsdp, ep) = {sizes} with efsdp = {region} // {d.ep}, and torch's "
        f"_unflatten raises ValueError: The product of mesh_sizes={sizes} is "
        f"{math.prod(sizes)}, but the original dimension at dim=0 has size {d.world_size} (the "
        f"torchtitan snapshot in meshsim's conventions raises the first sentence itself)",
        upstream="ValueError",
    )


def _views(version: str, backend: str, d: Degrees) -> _Views:
    """The views the current/intermediate ``build_mesh`` unflattens the world into."""
    world_size = d.world_size
    expert_axes = ("ep",) if version == "current" else ("ep", "etp")
    expert_sizes = (d.ep,) if version == "current" else (d.ep, d.etp)
    world = Layout(world=world_size)

    def unflatten(names: tuple[str, ...], sizes: tuple[int, ...]) -> Layout:
        if math.prod(sizes) != world_size:  # only the intermediate efsdp can get here
            raise LayoutError(
                f"The product of sizes={sizes} is {math.prod(sizes)}, but the size of dim "
                f"'world' is {world_size} (unflattening {names}: efsdp = dp_shard * cp * tp // "
                f"(etp * ep) does not tile the world)",
                upstream="ValueError",
            )
        return world.unflatten("world", sizes, names)

    batch, fsdp = d.dp_replicate * d.dp_shard, d.dp_shard * d.cp
    efsdp = fsdp * d.tp // math.prod(expert_sizes)
    dataloading = unflatten(("pp", "batch", "cp", "tp"), (d.pp, batch, d.cp, d.tp))
    loss = dataloading["batch", "cp"].flatten(name="loss_mesh")
    fwdbwd = None
    if backend == "partial_dtensor":
        dense = unflatten(("pp", "dp_replicate", "fsdp", "tp"), (d.pp, d.dp_replicate, fsdp, d.tp))
    else:
        dense = unflatten(
            ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
            (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp),
        )
        if backend == "spmd_types":
            fwdbwd = unflatten(("pp", "dp", "cp", "tp"), (d.pp, batch, d.cp, d.tp))[
                "dp", "cp", "tp"
            ]
    sparse = unflatten(
        ("pp", "dp_replicate", "efsdp", *expert_axes), (d.pp, d.dp_replicate, efsdp, *expert_sizes)
    )
    global_meshes = {"dataloading": dataloading, "loss": loss, "dense": dense, "sparse": sparse}
    if fwdbwd is not None:
        global_meshes["spmd_dense_for_fwdbwd"] = fwdbwd
        if d.ep > 1:
            global_meshes["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
    single = api.single_axis_meshes(global_meshes)
    if "etp" in expert_axes:
        single["etp"] = sparse["etp"]
    if fwdbwd is not None:
        single["dp"] = fwdbwd["dp"]
    if backend == "partial_dtensor":
        single["fsdp"] = dense["fsdp"]
    else:
        single["dp_shard"] = dense["dp_shard"]
    return _Views(d, version, backend, world, single, global_meshes)


def _views_for(world_size: int, config: Mapping[str, Any]) -> _Views:
    reject_unknown("torchtitan", config, PARAMETERS)
    version, backend, raw, ulysses = _parse(config)
    if version not in _UNFLATTENING or backend is None:
        raise LayoutError(
            f"get_mesh and get_all_one_dimensional_meshes exist in versions 'current' and "
            f"'intermediate'; version {version!r} has one root mesh: slice expect(...).layout"
        )
    return _views(version, backend, _degrees(world_size, version, raw, ulysses))


def get_mesh(world_size: int, dims: str | Sequence[str], **config: Any) -> Layout:
    """``ParallelDims.get_mesh(dims)``: one axis, or several sliced from the first global view
    holding them all (dataloading, loss, dense, sparse, then the spmd_types views); raises
    ValueError where an axis is off.

    Example: ``get_mesh(8, ["dp_replicate", "fsdp"], dp_replicate=2, dp_shard=2, tp=2,
    spmd_backend="partial_dtensor").shape`` is ``(2, 2)``.
    """
    return api.get_mesh(_views_for(world_size, config), dims)


def get_optional_mesh(
    world_size: int,
    dims: str | Sequence[str],
    *,
    include_singleton_axes: bool = False,
    **config: Any,
) -> Layout | None:
    """``ParallelDims.get_optional_mesh``: None where an axis is off, unless
    ``include_singleton_axes`` (then size-1 and fake-backed axes are returned too).

    Example: ``get_optional_mesh(8, "pp", dp_shard=8)`` is None, and with
    ``include_singleton_axes=True`` a size-1 layout per rank.
    """
    views = _views_for(world_size, config)
    return api.request(views, dims, singletons=include_singleton_axes)


def get_all_one_dimensional_meshes(world_size: int, **config: Any) -> dict[str, Groups]:
    """``ParallelDims.get_all_one_dimensional_meshes``: axis -> groups, for axes of size > 1.

    The current version also drops fake-backed axes (``efsdp`` when ep == 1); the intermediate
    one keeps them. Example: dp_replicate=2, dp_shard=2, tp=2 under spmd_types gives batch, loss,
    dp_replicate, tp, dp and dp_shard.
    """
    views = _views_for(world_size, config)
    return {
        axis: view.groups()
        for axis, view in views.single.items()
        if view.size > 1 and (views.version == "intermediate" or views.exists(axis))
    }


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """What torchtitan 0.3.0 (the ``current`` version) refuses at ``world_size``, one config
    per way to fail (``_torchtitan_api.refused_configs`` says which)."""
    return iter(api.refused_configs(world_size))


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every valid config of each version: all factorizations of the world into
    (pp, dp_replicate, dp_shard, cp, tp), each with every valid (ep, etp); then, per version,
    the options that change its groups, each crossed with a few of those layouts
    (:func:`~meshsim.model.sweep.spread`: every axis and pair of axes above 1 at least once):
    every SPMD backend other than the default, and ``dp_shard=-1``, left for torchtitan to
    infer (the code path ``ParallelDims`` takes when the degree is not given).

    ``versions=`` restricts the versions; ``spmd_backends=`` sweeps those backends over every
    layout instead (and no other; ``dp_shard=-1`` under the first). hyper_parallel rejects
    pp > 1 and makes ep a factor of the world, so it factorizes (dp_replicate, dp_shard, ep, cp,
    tp). World 8 gives 368 configs.

    Only what the described torch release builds: before 2.10 (no ``_unflatten``) the default
    versions are legacy and hyper_parallel, and hyper_parallel without cp (its ``loss`` flattens
    the flattened ``dp`` again, which those releases refuse) is left out.
    """
    old = not _torch_release.builds_unflatten()
    default = tuple(v for v in VERSIONS if not (old and v in _UNFLATTENING))
    versions = tuple(options.get("versions", default))
    unknown = set(versions) - set(VERSIONS)
    if unknown:
        raise LayoutError(f"unknown torchtitan versions {sorted(unknown)}; versions are {VERSIONS}")
    wanted = tuple(options.get("spmd_backends", ()))
    for version in versions:
        allowed = _BACKENDS.get(version, (None,))
        backends = [b for b in allowed if b in wanted] or [allowed[0]]
        layouts = list(_layouts(world_size, version, old))
        for config in layouts:
            for backend in backends:
                yield config if backend == allowed[0] else {**config, "spmd_backend": backend}
        picked = spread(layouts, _AXES)
        for backend in allowed[1:] if not wanted else ():
            yield from ({**config, "spmd_backend": backend} for config in picked)
        chosen = {"spmd_backend": backends[0]} if backends[0] != allowed[0] else {}
        yield from ({**config, "dp_shard": -1, **chosen} for config in picked)


#: The degrees :func:`configs` spreads the option cases over.
_AXES: Final = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def _layouts(world_size: int, version: str, old: bool) -> Iterator[dict[str, Any]]:
    """Every valid degree layout of one version, explicit, at its default backend."""
    if version == "hyper_parallel":
        for dpr, dps, ep, cp, tp in ordered_factorizations(world_size, 5):
            if old and cp == 1 and dpr * dps > 1:
                continue
            for etp in (1, tp) if ep > 1 and tp > 1 else (1,):
                degrees = dict(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=1, ep=ep)
                yield {"version": version, **degrees, "etp": etp}
        return
    for pp, dpr, dps, cp, tp in ordered_factorizations(world_size, 5):
        base = dict(version=version, pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp)
        for ep in divisors(dps * cp * tp):
            for etp in _valid_etps(version, dps, cp, tp, ep):
                yield {**base, "ep": ep, **({"etp": etp} if etp else {})}


def _valid_etps(version: str, dp_shard: int, cp: int, tp: int, ep: int) -> tuple[int, ...]:
    if version == "current":
        return (0,)  # no etp key
    if ep == 1:
        return (1,)
    etps = tuple(dict.fromkeys((tp, 1)))
    if version == "intermediate":
        return tuple(e for e in etps if (dp_shard * cp * tp) % (ep * e) == 0)
    return tuple(  # legacy: EP borrows cp [and tp] and part of dp_shard
        e
        for e in etps
        if ep % (cp * (tp if e == 1 else 1)) == 0
        and (dp_shard * cp * (tp if e == 1 else 1)) % ep == 0
    )
