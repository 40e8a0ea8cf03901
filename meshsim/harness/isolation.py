"""Keep torch.distributed's process-global state apart between ranks, runs and the caller.

torch keeps the default group, every group's bookkeeping (``_world``), the C++ group-name
registry, the "global rank" used in log prefixes and a ``sys.excepthook`` wrapper installed by
each ``init_process_group`` in process globals. The in-process tiers (fake, threaded) swap in
torch's own thread-local world (``ThreadLocalWorld`` from the threaded-PG test utilities)
and the C++ thread-isolation mode, so a caller that already has a process group keeps it
untouched, and everything is restored afterwards. ``leftovers`` lists state a rank left
behind (used by workers to decide whether they may be reused).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The swap is process-global: in-process runs (fake, threaded) take turns.
_in_process_lock = threading.Lock()
_active = threading.local()


def threaded_pg_module():  # type: ignore[no-untyped-def]
    """``torch.testing._internal.distributed.multi_threaded_pg``, imported once, lazily.

    On some torch versions it pulls in ``expecttest`` (a test-only dependency) and costs
    seconds to import, so it is only imported by the tiers that need it.
    """
    try:
        import torch.testing._internal.distributed.multi_threaded_pg as mtpg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from meshsim.errors import UsageError

        raise UsageError(
            f"the threaded/fake tiers need torch's test utilities, which failed to import "
            f"({exc}); install the test extra: pip install expecttest"
        ) from exc
    return mtpg


def _private_world_class(c10d: Any) -> type:
    """A ``c10d._World`` whose state lives on the instance, not in c10d's module globals.

    For ranks run one after another on one thread (the fake tier): every lookup is a plain
    attribute read, where torch's ``ThreadLocalWorld`` does a thread-local lookup per
    attribute (a fifth of the fake tier's time at world 1,024 went there).
    """
    probe = c10d._World()
    fields = tuple(
        name
        for name, attr in vars(c10d._World).items()
        if isinstance(attr, property) and name != "pg_config_info"
    )

    def _empty(name: str) -> Any:
        if name == "default_pg":
            return None
        value = getattr(probe, name)
        return type(value)() if isinstance(value, (dict, list, int)) else None

    def __init__(self: Any) -> None:
        self.__dict__.update({name: _empty(name) for name in fields})

    namespace: dict[str, Any] = dict.fromkeys(fields)
    namespace["__init__"] = __init__
    namespace["pg_config_info"] = c10d._World.pg_config_info
    return type("_PrivateWorld", (c10d._World,), namespace)


@contextmanager
def isolated_world(timeout: float, *, what: str, per_thread: bool = True) -> Iterator[None]:
    """Give the in-process ranks a private torch.distributed world; restore it afterwards.

    ``per_thread``: each thread gets its own world (the threaded tier's concurrent ranks);
    otherwise one private world for ranks that run in turn (the fake tier), which is cheaper.
    """
    import torch
    import torch.distributed.distributed_c10d as c10d

    from meshsim.errors import MeshsimError

    if getattr(_active, "inside", False):
        raise MeshsimError(
            f"meshsim.run({what}) was called from inside an in-process rank; nesting fake or "
            "threaded runs is not supported, call it from the test itself"
        )
    if not _in_process_lock.acquire(timeout=timeout):
        raise MeshsimError(
            f"another fake/threaded meshsim.run kept the in-process world busy for {timeout} s; "
            "in-process runs take turns (the swap of torch's world is process-global)"
        )
    if per_thread:
        mtpg = threaded_pg_module()

        class _IsolatedWorld(mtpg.ThreadLocalWorld):  # type: ignore[misc,name-defined]
            pg_config_info = c10d._World.pg_config_info
    else:
        _IsolatedWorld = _private_world_class(c10d)

    saved_world = c10d._world
    saved_autograd_mt = torch._C._is_multithreading_enabled()
    saved_hook = sys.excepthook
    saved_rank = c10d.get_rank() if c10d.is_initialized() else -1
    ext: Any = torch._C._distributed_c10d  # private bindings, not in torch's stubs
    _active.inside = True
    try:
        c10d._world = _IsolatedWorld()
        ext._set_thread_isolation_mode(True)
        yield
    finally:
        _active.inside = False
        c10d._world = saved_world
        ext._set_thread_isolation_mode(False)
        ext._set_global_rank(saved_rank)
        sys.excepthook = saved_hook
        # The threaded PG turns autograd multithreading off process-wide; turn it back.
        torch.autograd.set_multithreading_enabled(saved_autograd_mt)
        _in_process_lock.release()


def reset_rank_state(*, keep_default: bool = False) -> None:
    """Forget everything the previous rank built in this thread: groups, meshes, RNG tracker.

    ``keep_default``: the caller already destroyed every other group and keeps the world
    process group (a gloo worker's kept world).

    DeviceMesh keeps its flatten mapping and group registry on the root mesh object (garbage
    once the rank's body returned) and its ``_mesh_resources.mesh_stack`` in a thread-local,
    which is cleared here; DTensor's RNG tracker is a module global bound to a mesh.
    """
    import torch.distributed as dist

    if dist.is_initialized() and not keep_default:
        dist.destroy_process_group()
    mesh_mod = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(mesh_mod, "_mesh_resources", None)
    if resources is not None and hasattr(resources, "mesh_stack"):
        resources.mesh_stack.clear()
    random_mod = sys.modules.get("torch.distributed.tensor._random")
    if random_mod is not None and getattr(random_mod, "_rng_tracker", None) is not None:
        random_mod._rng_tracker = None  # type: ignore[attr-defined]
    if "torch.distributed.tensor._api" in sys.modules:
        forget_dtensor_plans()


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribute plans.

    They are keyed by specs whose meshes compare equal across runs, so a plan cached by the
    previous job of a warm worker (or the previous fake rank) names process groups that job
    destroyed: "Could not resolve the process group registered under the name 10".
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    plans = getattr(_redistribute, "_gen_transform_infos", None)
    if plans is not None and hasattr(plans, "cache_clear"):
        plans.cache_clear()


def leftovers(kept: Any = None) -> list[str]:
    """Distributed state still alive in this thread/process; empty when clean.

    ``kept``: the world process group the caller deliberately keeps (it must be the default
    group and the only one registered).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    found: list[str] = []
    if kept is None and dist.is_initialized():
        found.append("a default process group is still initialised")
    if kept is not None and not (dist.is_initialized() and c10d._get_default_group() is kept):
        found.append("the kept world process group is no longer the default group")
    others = [pg for pg in c10d._world.pg_map if pg is not kept]
    if others:
        found.append(f"{len(others)} process group(s) still registered")
    mesh_mod = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(mesh_mod, "_mesh_resources", None)
    if resources is not None and getattr(resources, "mesh_stack", None):
        found.append("a DeviceMesh context (with mesh:) is still entered")
    random_mod = sys.modules.get("torch.distributed.tensor._random")
    if random_mod is not None and getattr(random_mod, "_rng_tracker", None) is not None:
        found.append("DTensor's RNG tracker is still bound to a mesh")
    return found
