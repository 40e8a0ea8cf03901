"""Every private torch name meshsim touches, each behind one accessor.

torch's distributed internals (c10d's ``_World``, ``DeviceMesh``'s root and flatten
bookkeeping, the CuTe ``_mesh_layout``, the threaded and fake test backends, DTensor's plan
caches) change from release to release. meshsim reaches them only through this module, so a
new torch release is a change here, and :data:`SURFACE` lists each name with the releases that
have it: ``tests/test_torch_private.py`` checks every entry on the running torch and names the
missing one with the torch version, instead of a failure deep inside a tier.

Importing this module does not import torch; each accessor imports what it needs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from meshsim.errors import MeshsimError

C10D = "torch.distributed.distributed_c10d"
DEVICE_MESH = "torch.distributed.device_mesh"
MESH_LAYOUT = "torch.distributed._mesh_layout"
THREADED_PG = "torch.testing._internal.distributed.multi_threaded_pg"
FAKE_PG = "torch.testing._internal.distributed.fake_pg"
C10D_BINDINGS = "torch._C._distributed_c10d"
FUNCOL = "torch.distributed._functional_collectives"
DTENSOR_DEBUG = "torch.distributed.tensor.debug"
FSDP2 = "torch.distributed.fsdp._fully_shard._fully_shard"


@dataclass(frozen=True)
class Private:
    """One private name: ``module`` holds ``path`` (``Class.attr`` for a class member)."""

    module: str
    path: str
    use: str  # what meshsim needs it for
    since: tuple[int, int] = (2, 6)  # the first release that has it
    until: tuple[int, int] | None = None  # the last release that has it (None: still there)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    def expected(self, version: tuple[int, int]) -> bool:
        """The release ``version`` should have this name."""
        return self.since <= version and (self.until is None or version <= self.until)

    def lookup(self) -> Any:
        """The object, or AttributeError/ImportError naming what is missing."""
        obj: Any = importlib.import_module(self.module)
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj


def _names(
    module: str, uses: Mapping[str, str], since: tuple[int, int] = (2, 6)
) -> tuple[Private, ...]:
    """``module``'s names (``path: use``) that first appear in torch ``since``."""
    return tuple(Private(module, path, use, since) for path, use in uses.items())


SURFACE: tuple[Private, ...] = (
    # c10d's process-global world (the in-process tiers swap it; workers reuse the world group)
    *_names(
        C10D,
        {
            "_World": "a private world per in-process run (isolation)",
            "_world": "the world the in-process tiers swap; group bookkeeping",
            "_World.pg_config_info": "kept on the private world class",
            "_get_default_group": "the world group of the running rank",
            "_get_default_store": "ranks' claimed groups, compared before proving",
            "_resolve_process_group": "group names in recorded calls",
            "STORE_BASED_BARRIER_PREFIX": "the new-group barrier's keys (threaded)",
            "_new_group_with_tag": "the fake fast path: a body that patched new_group",
            "_is_barrier_after_init": "the fake fast path: TORCH_DIST_INIT_BARRIER",
            "ProcessGroup._get_sequence_number_for_group": "a kept world's health mark",
        },
    ),
    *_names(
        C10D_BINDINGS,
        {
            "_set_thread_isolation_mode": "per-thread group names (threaded)",
            "_set_global_rank": "log prefixes restored after a run",
        },
    ),
    *_names("torch._C", {"_is_multithreading_enabled": "autograd threading restored after a run"}),
    # DeviceMesh's bookkeeping
    *_names(
        DEVICE_MESH,
        {
            "DeviceMesh._flatten": "flattened dims (every convention)",
            "_mesh_resources": "the root and flatten mapping; `with mesh:` stack",
        },
    ),
    *_names(
        DEVICE_MESH,
        {
            "DeviceMesh._get_root_mesh": "the root of a view",
            "DeviceMesh._unflatten": "splitting a dim",
            "DeviceMesh._init_one_process_group": "fake fast path",
        },
        since=(2, 10),
    ),
    *_names(MESH_LAYOUT, {"_MeshLayout": "fake fast path: a dim's groups"}, since=(2, 10)),
    *_names(MESH_LAYOUT, {"_FlatLayout": "fake fast path: one axis"}, since=(2, 13)),
    # torch's test backends
    *_names(
        THREADED_PG,
        {
            "ThreadLocalWorld": "the threaded tier's per-thread world",
            "ProcessLocalGroup": "the threaded tier's process group",
            "ProcessLocalGroup._terminate": "an aborted threaded world",
            "ProcessLocalGroup._coll_lock": "the live-collective table's lock (abort)",
            "ProcessLocalGroup._cur_coll_on_pgs": "the live collectives an abort wakes",
            "Collective.join": "a collective's wait, stepped out of the RNG lock",
            "_store_based_barrier": "the new-group barrier, made abortable",
        },
    ),
    *_names(C10D, {"ProcessGroup._get_backend": "batch_isend_irecv on the threaded tier"}),
    *_names(FAKE_PG, {"FakeProcessGroup": "the fake tier's process group"}),
    # collectives and DTensor
    *_names(FUNCOL, {"all_reduce": "recording functional collectives"}),
    *_names(FSDP2, {"FSDPModule._get_fsdp_state": "the groups fully_shard reduces over"}),
    *_names(DTENSOR_DEBUG, {"_clear_sharding_prop_cache": "stale DTensor plans"}, since=(2, 11)),
    *_names("torch.distributed.tensor._random", {"_rng_tracker": "DTensor's RNG per rank"}),
    *_names("torch._C", {"_ensureCUDADeviceGuardSet": "no GPU: threaded DTensor"}, since=(2, 10)),
)


class TorchTooOld(MeshsimError):
    """The running torch lacks a private name a feature needs; names both versions.

    A program calling the missing method fails with ``AttributeError`` there (``upstream``).
    """

    upstream = "AttributeError"


#: The oldest torch release meshsim runs on (pyproject.toml's floor). torch 2.6's ``fully_shard``
#: cannot run on CPU ("'Stream' object has no attribute 'record_event'"), so the data-flow
#: check cannot run there, and its DeviceMesh cannot slice a slice nor refuse a flatten into a
#: root dim's name; the README's "Torch releases" section has the measurements.
SUPPORTED_SINCE = (2, 9)


def require_supported() -> None:
    """Raise one line naming the torch found and the one needed, below :data:`SUPPORTED_SINCE`."""
    found = torch_version()
    if found < SUPPORTED_SINCE:
        raise TorchTooOld(
            f"meshsim needs torch >= {SUPPORTED_SINCE[0]}.{SUPPORTED_SINCE[1]}, found torch "
            f"{found[0]}.{found[1]}; install a newer torch (meshsim is tested on 2.9.1 to 2.15.0)"
        )


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def missing(version: tuple[int, int] | None = None) -> list[str]:
    """Names of :data:`SURFACE` the running torch should have and does not."""
    version = version or torch_version()
    gone: list[str] = []
    for entry in SURFACE:
        if not entry.expected(version):
            continue
        try:
            entry.lookup()
        except (AttributeError, ImportError):
            gone.append(entry.name)
    return gone


def require(path: str, module: str = DEVICE_MESH) -> Any:
    """The private name, or :class:`TorchTooOld` naming it, what it is for and the torch."""
    entry = next((e for e in SURFACE if e.path == path and e.module == module), None)
    if entry is None:  # pragma: no cover - a programming error in meshsim
        raise KeyError(f"{module}.{path} is not in meshsim.torch_private.SURFACE")
    try:
        return entry.lookup()
    except (AttributeError, ImportError) as exc:
        import torch

        since = ".".join(map(str, entry.since))
        raise TorchTooOld(
            f"torch {torch.__version__} has no {entry.name} ({entry.use}); "
            f"it first appears in torch {since}"
        ) from exc


# -- c10d -----------------------------------------------------------------------------------


def c10d() -> ModuleType:
    import torch.distributed.distributed_c10d as module

    return module


def world() -> Any:
    """c10d's ``_world``: every group's bookkeeping (``pg_map``, ``group_count``, ...)."""
    return c10d()._world


def set_world(value: Any) -> None:
    c10d()._world = value


def world_class() -> type:
    return c10d()._World


def default_group() -> Any:
    return c10d()._get_default_group()


def default_store() -> Any:
    return c10d()._get_default_store()


def resolve_group(group: Any) -> Any:
    return c10d()._resolve_process_group(group)


def new_group_with_tag() -> Any:
    return c10d()._new_group_with_tag


def barrier_after_init() -> bool:
    return c10d()._is_barrier_after_init() == 1


def sequence_number(group: Any) -> int:
    return int(group._get_sequence_number_for_group())


def thread_isolation(on: bool) -> None:
    """C++ group-name registry per thread (threaded tier) or per process."""
    import torch

    torch._C._distributed_c10d._set_thread_isolation_mode(on)  # type: ignore[attr-defined]


def set_global_rank(rank: int) -> None:
    import torch

    torch._C._distributed_c10d._set_global_rank(rank)  # type: ignore[attr-defined]


def autograd_multithreading() -> bool:
    import torch

    return bool(torch._C._is_multithreading_enabled())


def preload() -> None:
    """Import the torch.distributed modules every rank uses (a worker's template does, once)."""
    import torch.distributed.device_mesh  # noqa: F401

    functional_collectives()


def functional_collectives() -> ModuleType:
    return importlib.import_module(FUNCOL)


def fsdp_state(module: Any) -> Any:
    """``fully_shard``'s state of ``module`` (its param group holds the params and mesh info)."""
    return require("FSDPModule._get_fsdp_state", FSDP2)(module)


# -- torch's test backends ------------------------------------------------------------------


def threaded_pg() -> ModuleType:
    """``multi_threaded_pg``, imported once, lazily (on some releases it needs expecttest)."""
    try:
        return importlib.import_module(THREADED_PG)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from meshsim.errors import UsageError

        raise UsageError(
            f"the threaded/fake tiers need torch's test utilities, which failed to import "
            f"({exc}); install the test extra: pip install expecttest"
        ) from exc


def threaded_world_aborted() -> bool:
    """The threaded world was aborted (a rank failed) while ranks were in a collective."""
    return bool(threaded_pg().ProcessLocalGroup._terminate.is_set())


def abort_threaded_world() -> None:
    """Make every rank thread waiting in a threaded collective, now or later, leave it.

    The same steps as torch's ``ProcessLocalGroup.exception_handle`` (set the termination
    event, wake each live collective's waiters), with the table of live collectives read
    under the lock that guards it. torch walks that table unlocked while other ranks start
    and end collectives in it, so an abort could raise "dictionary changed size during
    iteration" and leave some waiters asleep. Waiters check the event before sleeping, so a
    collective started after the table was read never blocks.
    """
    plg = threaded_pg().ProcessLocalGroup
    plg._terminate.set()
    with plg._coll_lock:
        live = list(plg._cur_coll_on_pgs.values())
    for coll in live:
        for cond in (coll._start_cond, coll._done_cond):
            with cond:
                cond.notify_all()


def make_threaded_group_its_own_backend(plg: type) -> None:
    """A threaded group answers ``_get_backend(device)`` with itself, once per class.

    torch >= 2.14's ``batch_isend_irecv`` asks ``group._get_backend(device)`` whether it may
    coalesce. ``ProcessLocalGroup`` is a Python ``ProcessGroup`` subclass with no registered
    device backend, so the question raised "No backend type associated with device type
    cpu" where gloo answers "no". Answering with the group itself (no ``supports_coalescing``)
    takes torch's one-op-at-a-time path, as on gloo; callers that caught the RuntimeError
    (abort, uid lookup) read the same "not NCCL, no coalescing" from it.
    """
    if getattr(plg, "__meshsim_own_backend__", False):
        return
    original = plg._get_backend

    def _get_backend(self: Any, device: Any) -> Any:
        try:
            return original(self, device)
        except RuntimeError:
            return self

    plg._get_backend = _get_backend  # type: ignore[attr-defined]
    plg.__meshsim_own_backend__ = True  # type: ignore[attr-defined]


def register_fake_backend() -> None:
    importlib.import_module(FAKE_PG)  # importing registers the "fake" backend


def store_barrier_prefix() -> str:
    """The store key prefix of c10d's barrier after ``new_group``."""
    return str(sys.modules[C10D].STORE_BASED_BARRIER_PREFIX)


def threaded_group_rank(group: Any) -> int:
    """The rank of this thread in a threaded-tier group."""
    return int(group._rank)


# -- DeviceMesh -----------------------------------------------------------------------------


def _mesh_resources() -> Any:
    return sys.modules[DEVICE_MESH]._mesh_resources  # type: ignore[attr-defined]


def root_mesh(mesh: Any) -> Any:
    """The root a view was sliced, flattened or unflattened from (itself for a root)."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    return _mesh_resources().get_root_mesh(mesh)


def flatten_mapping(mesh: Any) -> dict[str, Any]:
    """Flattened name -> 1-D mesh, as registered on the root of ``mesh``."""
    root = root_mesh(mesh)
    mapping = getattr(root, "_flatten_mapping", None)
    if mapping is None:  # torch < 2.10 keeps it in _mesh_resources
        mapping = _mesh_resources().root_to_flatten_mapping.get(root, {})
    return dict(mapping)


def flatten(mesh: Any, name: str) -> Any:
    """``mesh._flatten(name)``: one dim over all of ``mesh``'s dims, registered on the root."""
    return mesh._flatten(name)


def unflatten(
    mesh: Any,
    dim: int | str,
    sizes: tuple[int, ...],
    names: tuple[str, ...],
    *,
    emulate: bool = False,
    backend_override: Mapping[str, str] | None = None,
) -> Any:
    """``mesh._unflatten(dim, sizes, names)``: ``dim`` split row-major into ``names``.

    On a release without ``_unflatten`` (torch < 2.10) this raises :class:`TorchTooOld`, as a
    program calling it there fails; ``emulate=True`` (meshsim's own builders, whose frameworks
    do not call ``_unflatten``) builds the groups torch 2.13+ would, on every release.
    ``backend_override`` (name -> backend, as torchtitan passes ``"fake"`` for its size-1 axes)
    is not emulated.
    """
    if not emulate:
        require("DeviceMesh._unflatten")
        if backend_override:
            return mesh._unflatten(dim, sizes, names, backend_override=dict(backend_override))
        return mesh._unflatten(dim, sizes, names)
    if isinstance(dim, str):  # torch 2.10 refuses every dim given by name (its check is inverted)
        dim = tuple(mesh.mesh_dim_names or ()).index(dim)
    if torch_version() >= (2, 13):
        return mesh._unflatten(dim, sizes, names)
    return _unflatten_by_construction(mesh, int(dim), tuple(sizes), tuple(names))


_REST = "meshsim_rest"


def _unflatten_by_construction(
    mesh: Any, index: int, sizes: tuple[int, ...], names: tuple[str, ...]
) -> Any:
    """``_unflatten`` built from a new root over the whole world (torch < 2.13).

    torch < 2.10 has no ``_unflatten``; 2.10-2.12 unflatten a non-contiguous flattened dim into
    dims they then refuse to slice ("only allows slicing out a contiguous flattened dim"). Every
    rank lays out all of the world's copies of ``mesh`` as one tensor with ``dim`` split into
    ``sizes``, builds a ``DeviceMesh`` over it (collective: the same groups in the same order on
    every rank) and slices its own copy out: the groups ``_unflatten`` makes on 2.13+.
    """
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    own = tuple(mesh.mesh_dim_names or ())
    if math.prod(sizes) != mesh.mesh.shape[index] or len(sizes) != len(names):
        raise ValueError(
            f"cannot unflatten dim {index} of size {mesh.mesh.shape[index]} into "
            f"{dict(zip(names, sizes))}"
        )
    copies = _copies(mesh).reshape(-1, *mesh.mesh.shape)
    me = dist.get_rank()
    if not any(bool((copy == me).any()) and copy.equal(mesh.mesh) for copy in copies):
        raise TorchTooOld(
            f"meshsim cannot rebuild {mesh} from its root on this torch; torch >= 2.13 "
            f"unflattens any view"
        )
    shape = (*mesh.mesh.shape[:index], *sizes, *mesh.mesh.shape[index + 1 :])
    new_names = (*own[:index], *names, *own[index + 1 :])
    world = DeviceMesh(
        mesh.device_type, copies.reshape(-1, *shape), mesh_dim_names=(_REST, *new_names)
    )
    return world[new_names]


def _copies(mesh: Any) -> Any:
    """Every copy of ``mesh`` across the world (one per rank group), as one rank tensor."""
    layout = getattr(mesh, "_layout", None)
    if layout is not None:  # torch >= 2.10: the view's CuTe layout over its root's ranks
        return layout.remap_to_tensor(mesh._rank_map)
    root = root_mesh(mesh)  # torch < 2.10: the root's dims, permuted so the view's come last
    spans = [_root_dims(root, name) for name in tuple(mesh.mesh_dim_names or ())]
    taken = [d for span in spans for d in span]
    rest = [d for d in range(root.mesh.ndim) if d not in taken]
    return root.mesh.permute(*rest, *taken)


def _root_dims(root: Any, name: str) -> tuple[int, ...]:
    """The root dims a dim of a view spans (one, or a flattened name's several)."""
    root_names = tuple(root.mesh_dim_names or ())
    if name in root_names:
        return (root_names.index(name),)
    flattened = _mesh_resources().flatten_name_to_root_dims.get(root, {})
    if name in flattened:
        return tuple(flattened[name])
    raise TorchTooOld(f"torch < 2.10: cannot find dim {name!r} of a view on its root {root}")


def _mesh_stack() -> list[Any]:
    """DeviceMesh's thread-local stack of ``with mesh:`` contexts (empty before any mesh)."""
    resources = getattr(sys.modules.get(DEVICE_MESH), "_mesh_resources", None)
    return getattr(resources, "mesh_stack", None) or []


def mesh_stack_entered() -> bool:
    return bool(_mesh_stack())


#: ``_mesh_resources`` registries of torch < 2.10, keyed by meshes that compare equal by
#: value: a rank run after another in the same thread (the fake tier) would get the previous
#: rank's flattened meshes back ("Quick return if the flatten mesh has been created before").
_OLD_MESH_REGISTRIES = (
    "child_to_root_mapping",
    "root_to_flatten_mapping",
    "flatten_name_to_root_dims",
    "mesh_dim_group_options",
)


def reset_mesh_resources() -> None:
    """Forget the meshes a rank made: ``with mesh:`` contexts, and torch < 2.10's registries."""
    _mesh_stack().clear()
    resources = getattr(sys.modules.get(DEVICE_MESH), "_mesh_resources", None)
    for name in _OLD_MESH_REGISTRIES:
        registry = getattr(resources, name, None)
        if isinstance(registry, dict):
            registry.clear()


def mesh_group_factory() -> Any:
    """``DeviceMesh._init_one_process_group`` as stored on the class (a staticmethod), or None
    on a release that creates a mesh's groups another way."""
    return vars(importlib.import_module(DEVICE_MESH).DeviceMesh).get("_init_one_process_group")


def set_mesh_group_factory(factory: Any) -> None:
    importlib.import_module(DEVICE_MESH).DeviceMesh._init_one_process_group = factory


def mesh_layout_classes() -> tuple[type, ...]:
    """torch's layout classes (``_MeshLayout``, and ``_FlatLayout`` from 2.13), or none on a
    release without the CuTe layout module."""
    try:
        layout = importlib.import_module(MESH_LAYOUT)
    except ImportError:
        return ()
    return tuple(
        getattr(layout, name) for name in ("_MeshLayout", "_FlatLayout") if hasattr(layout, name)
    )


def mesh_layout_axis(sub_layout: Any) -> Any:
    """One dim's ``_MeshLayout``: 2.13+ passes a ``_FlatLayout`` axis, 2.10-2.12 the layout."""
    layout = importlib.import_module(MESH_LAYOUT)
    if hasattr(layout, "_FlatLayout"):
        return layout._MeshLayout([sub_layout])
    return sub_layout


# -- DTensor --------------------------------------------------------------------------------


def settle_cuda_device_guard() -> None:
    """Install torch's no-op CUDA device guard now, from this thread, where CUDA is absent.

    A CUDA build of torch on a machine without a GPU swaps it in the first time DTensor's
    shape propagation enters a ``FakeTensorMode`` (``torch._C._ensureCUDADeviceGuardSet``).
    Done from a rank thread while other ranks run DTensor code, the swap segfaulted torch
    2.10 (the second threaded run of a process that shards modules). Done once up front, the
    later calls find it set.
    """
    import torch

    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and torch.version.cuda is not None and not torch.cuda.is_available():
        ensure()


def dtensor_loaded() -> bool:
    return "torch.distributed.tensor._api" in sys.modules


def dtensor_rng_bound() -> bool:
    module = sys.modules.get("torch.distributed.tensor._random")
    return module is not None and getattr(module, "_rng_tracker", None) is not None


def reset_dtensor_rng() -> None:
    module = sys.modules.get("torch.distributed.tensor._random")
    if module is not None and getattr(module, "_rng_tracker", None) is not None:
        module._rng_tracker = None  # type: ignore[attr-defined]


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribute plans.

    They are keyed by specs whose meshes compare equal across runs, so a plan cached by the
    previous job of a warm worker (or the previous fake rank) names process groups that job
    destroyed: "Could not resolve the process group registered under the name 10".
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._api import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    debug = importlib.import_module(DTENSOR_DEBUG)
    if hasattr(debug, "_clear_sharding_prop_cache"):  # torch >= 2.11: both caches
        debug._clear_sharding_prop_cache()
    else:  # torch 2.10: the two caches apart; older: the propagator's own lru_cache
        for name in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
            if hasattr(debug, name):
                getattr(debug, name)()
        cached = getattr(propagator, "propagate_op_sharding", None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    for owner, name in (
        (propagator, "_propagate_tensor_meta_cached"),
        (_redistribute, "_gen_transform_infos"),
    ):
        cached = getattr(owner, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
