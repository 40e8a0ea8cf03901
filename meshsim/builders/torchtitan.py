"""torchtitan builder: ``ParallelDims.build_mesh`` of each version, replayed on live torch meshes.

* current / intermediate: a 1-D ``world`` mesh ``_unflatten``-ed into the dataloading, dense,
  sparse (and spmd_types fwd/bwd) views, ``loss`` = ``dataloading["batch", "cp"]._flatten``;
  single axes are sliced from those live views as ``get_mesh`` does. The dense view is
  ``(pp, dp_replicate, fsdp, tp)`` under partial_dtensor and ``(pp, dp_replicate, dp_shard, cp,
  tp)`` under spmd_types and full_dtensor (current: all three, as torchtitan 0.3.0);
* legacy: one root mesh over the dims of degree > 1 (dp_shard split for EP), then ``_flatten``
  of dp / dp_shard_cp / dp_cp / ep on it;
* hyper_parallel: the seed's root mesh and its ``fsdp`` / ``dp`` / ``loss`` flatten aliases.

Axes torchtitan counts as off are unflattened with the ``fake`` backend, as torchtitan does;
``get_mesh`` refuses them, so they are recorded as absent there, and observed (with their
backend) where ``get_optional_mesh(..., include_singleton_axes=True)`` hands them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders import _torchtitan_api as titan_api
from meshsim.builders._common import Entry, collect, mesh, reference_rules
from meshsim.builders.real._shims import register_fake_backend
from meshsim.checks import Observation
from meshsim.model.conventions import torchtitan
from meshsim.model.conventions._torchtitan_api import single_axis_meshes
from meshsim.model.conventions._torchtitan_legacy import validate_dense

#: Every name legacy torchtitan code slices from its root mesh (absent ones raise KeyError).
_LEGACY_NAMES = (
    "pp", "dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp",
    "dp", "dp_shard_cp", "dp_cp", "ep",
)  # fmt: skip


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    with reference_rules():
        version, backend, degrees = torchtitan.validate(world_size, config)
    d = dataclasses.asdict(degrees)
    if version == "hyper_parallel":
        return collect(_hyper_parallel(world_size, d))
    if version == "legacy":
        return collect(_legacy(d))
    assert backend is not None  # the convention gives every multi-view version its default
    expert = {"ep": d["ep"]} if version == "current" else {"ep": d["ep"], "etp": d["etp"]}
    replica = _views(world_size, d, backend, expert, version)
    if version == "intermediate":
        return collect(replica.entries())
    return titan_api.observe(titan_api.entries(replica))


def _validate(world_size: int, raw: Mapping[str, int], *, with_etp: bool) -> dict[str, int]:
    """``ParallelDims._validate`` by the convention's statement of it: degrees >= 1, dp_shard
    -1 resolved, the product the world (the data-flow recipe's entry; ``build`` takes all of a
    version's checks from ``torchtitan.validate``)."""
    with reference_rules():
        degrees = validate_dense(world_size, {"etp": 1, **raw}, with_etp=with_etp)
    return dataclasses.asdict(degrees)


def _views(
    world_size: int, d: Mapping[str, int], backend: str, expert: Mapping[str, int], version: str
) -> _Replica:
    """The current/intermediate ``build_mesh``: unflatten one world mesh into every view."""
    world = mesh((world_size,), ("world",))
    # torchtitan's _mesh_exist: which axes get a real backend (the others are unflattened
    # "fake"). dp_shard, the dense storage axis, stays real at size 1 under spmd_types, and in
    # 0.3.0 (current) under full_dtensor too.
    storage = ("spmd_types", "full_dtensor") if version == "current" else ("spmd_types",)

    def exists(axis: str, degree: int) -> bool:
        if axis == "fsdp" or (axis == "dp_shard" and backend in storage):
            return True
        return d["ep"] > 1 if axis == "efsdp" else degree > 1

    def unflatten(dims: Mapping[str, int]) -> DeviceMesh:
        fake = {name: "fake" for name, degree in dims.items() if not exists(name, degree)}
        if fake:
            register_fake_backend()
        return torch_private.unflatten(
            world, 0, tuple(dims.values()), tuple(dims), backend_override=fake
        )

    pp, dpr, dps, cp, tp, ep = (d[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    batch, fsdp = dpr * dps, dps * cp
    dataloading = unflatten({"pp": pp, "batch": batch, "cp": cp, "tp": tp})
    loss = torch_private.flatten(dataloading["batch", "cp"], "loss_mesh")
    if backend == "partial_dtensor":
        dense = unflatten({"pp": pp, "dp_replicate": dpr, "fsdp": fsdp, "tp": tp})
    else:
        dense = unflatten({"pp": pp, "dp_replicate": dpr, "dp_shard": dps, "cp": cp, "tp": tp})
    efsdp = fsdp * tp // math.prod(expert.values())
    sparse = unflatten({"pp": pp, "dp_replicate": dpr, "efsdp": efsdp, **expert})
    views = {"dataloading": dataloading, "loss": loss, "dense": dense, "sparse": sparse}
    single: dict[str, DeviceMesh] = single_axis_meshes(views)
    if "etp" in expert:
        single["etp"] = sparse["etp"]
    if backend == "spmd_types":
        fwdbwd = unflatten({"pp": pp, "dp": batch, "cp": cp, "tp": tp})["dp", "cp", "tp"]
        views["spmd_dense_for_fwdbwd"] = fwdbwd
        if ep > 1:
            views["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
        single["dp"] = fwdbwd["dp"]
    if backend == "partial_dtensor":
        single["fsdp"] = dense["fsdp"]
    else:
        single["dp_shard"] = dense["dp_shard"]
    real = {axis: exists(axis, view.size()) for axis, view in single.items()}
    return _Replica(world, single, views, real, backend)


class _Replica:
    """The getters of torchtitan 0.3.0's ``ParallelDims``, answered from the live views above
    (the rules as documented in ``meshsim.model.conventions._torchtitan_api``), so the same
    questions can be put to plain torch and to torchtitan itself."""

    _DENSE: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "spmd_types": ("dp", "cp", "tp"),
        "full_dtensor": ("dp_replicate", "dp_shard", "cp", "tp"),
        "partial_dtensor": ("dp_replicate", "fsdp", "tp"),
    }

    def __init__(
        self,
        world: DeviceMesh,
        single: dict[str, DeviceMesh],
        views: dict[str, DeviceMesh],
        real: dict[str, bool],
        backend: str,
    ) -> None:
        self.world_mesh = world
        self._single_axis_meshes = single
        self._global_meshes = views
        self._real = real
        self._backend = backend
        # Each answer is a slice of a live view, the same whenever it is asked: kept, since
        # ``meshsim.builders._torchtitan_api.entries`` asks ~200 questions per rank and every
        # slice builds a DeviceMesh (most of the fake tier's time on torchtitan layouts).
        self._sliced: dict[tuple[str, ...], DeviceMesh] = {}
        self._spmd: list[DeviceMesh] | None = None

    def entries(self) -> dict[str, Entry]:
        """``get_mesh`` of each axis torchtitan registers (the intermediate version's kinds)."""
        return {
            axis: view if self._real[axis] else ValueError(f"Mesh '{axis}' is not available.")
            for axis, view in self._single_axis_meshes.items()
        }

    def get_optional_mesh(
        self, dims: str | list[str], *, include_singleton_axes: bool = False
    ) -> DeviceMesh | None:
        names = [dims] if isinstance(dims, str) else list(dims)
        unknown = [n for n in names if n not in self._single_axis_meshes]
        if unknown:
            raise ValueError(f"Invalid mesh dim: '{unknown[0]}'.")
        if not include_singleton_axes and not all(self._real[n] for n in names):
            return None
        if len(names) == 1:
            return self._single_axis_meshes[names[0]]
        key = tuple(names)
        if key not in self._sliced:
            for view in self._global_meshes.values():
                if set(names) <= set(view.mesh_dim_names or ()):
                    self._sliced[key] = view[key]
                    break
            else:
                raise ValueError(f"Invalid mesh name combinations {names}.")
        return self._sliced[key]

    def get_mesh(self, dims: str | list[str]) -> DeviceMesh:
        found = self.get_optional_mesh(dims)
        if found is None:
            raise ValueError(f"Mesh '{dims}' is not available.")
        return found

    def spmd_meshes(self) -> list[DeviceMesh]:
        if self._spmd is None:
            out = []
            for axes in (self._DENSE[self._backend], ("dp_replicate", "efsdp", "ep")):
                active = [a for a in axes if self._real.get(a)]
                if active:
                    out.append(self.get_mesh(active if len(active) > 1 else active[0]))
            self._spmd = out
        return list(self._spmd)

    def spmd_dense_mesh(self) -> DeviceMesh:
        return self._global_meshes["spmd_dense_for_fwdbwd"]

    def spmd_sparse_mesh(self) -> DeviceMesh | None:
        return self._global_meshes.get("spmd_sparse_for_fwdbwd")

    def get_dense_tp_mesh(self) -> DeviceMesh:
        if self._backend == "spmd_types":
            return self.spmd_dense_mesh()["tp"]
        if self._backend == "full_dtensor":
            return self.spmd_meshes()[0]["tp"]
        return self.get_mesh("tp")


def _root_entries(root: DeviceMesh, names: tuple[str, ...]) -> dict[str, Entry]:
    """``root[name]`` for each name, or what torch raises for it: KeyError for a name it lacks,
    NotImplementedError (torch 2.10-2.12) for a flattened dim that is not contiguous."""
    entries: dict[str, Entry] = {}
    for name in names:
        try:
            entries[name] = root[name]
        except (KeyError, NotImplementedError) as error:
            entries[name] = error
    return entries


def _legacy(d: Mapping[str, int]) -> dict[str, Entry]:
    """Legacy ``build_mesh``: dims of degree > 1; with EP, dp_shard is split for the experts."""
    ep, etp, tp, cp = d["ep"], d["etp"], d["tp"], d["cp"]
    sizes: list[tuple[str, int]]
    if ep > 1:
        borrowed = cp if etp == tp else cp * tp
        sizes = [
            ("pp", d["pp"]),
            ("dp_replicate", d["dp_replicate"]),
            ("dp_shard_mod_ep", d["dp_shard"] * borrowed // ep),
            ("dp_shard_in_ep", ep // borrowed),
            ("cp", cp),
            ("tp", tp),
        ]
        dims = [(n, s) for n, s in sizes if s > 1 or n == "dp_shard_mod_ep"]
        shard = ["dp_shard_mod_ep", "dp_shard_in_ep"]
    else:
        sizes = [(n, d[n]) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
        dims = [(n, s) for n, s in sizes if s > 1]
        shard = ["dp_shard"]
    root = mesh([s for _, s in dims], [n for n, _ in dims])
    kept = set(root.mesh_dim_names or ())
    replicate = [n for n in ("dp_replicate",) if n in kept]
    shard = [n for n in shard if n in kept]
    cps = [n for n in ("cp",) if n in kept]
    flattens = {
        "dp": replicate + shard,
        "dp_shard_cp": shard + cps,
        "dp_cp": replicate + shard + cps,
    }
    if ep > 1:
        flattens["ep"] = [n for n in ("dp_shard_in_ep", "cp") if n in kept]
        flattens["ep"] += ["tp"] if etp == 1 and "tp" in kept else []
    for alias, spanned in flattens.items():
        if spanned:
            torch_private.flatten(root[tuple(spanned)], alias)
    return _root_entries(root, _LEGACY_NAMES)


def _hyper_parallel(world_size: int, d: Mapping[str, int]) -> dict[str, Entry]:
    """The hyper_parallel seed (degrees validated): one root mesh, flatten aliases fsdp / dp /
    loss."""
    order = ("dp_replicate", "dp_shard", "ep", "cp", "tp", "pp")
    dims = [(n, d[n]) for n in order if d[n] > 1] or [("dp_shard", world_size)]
    root = mesh([s for _, s in dims], [n for n, _ in dims])
    base = set(root.mesh_dim_names or ())
    done: set[str] = set()

    def flatten_unique(source: tuple[str, ...], alias: str) -> None:
        if alias not in base and alias not in done:
            torch_private.flatten(root[source], alias)
            done.add(alias)

    data = tuple(n for n in ("dp_replicate", "dp_shard") if n in base)
    if "dp_shard" in base:
        flatten_unique(("dp_shard",), "fsdp")
    if data:
        flatten_unique(data, "dp")
    if "cp" in base:
        flatten_unique((*data, "cp"), "loss")
    elif "dp" in done:
        flatten_unique(("dp",), "loss")
    return _root_entries(root, (*order, "fsdp", "dp", "loss"))
