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

from meshsim import torch_private

# The swap is process-global: in-process runs (fake, threaded) take turns.
_in_process_lock = threading.Lock()
_active = threading.local()


def _private_world_class() -> type:
    """A ``c10d._World`` whose state lives on the instance, not in c10d's module globals.

    For ranks run one after another on one thread (the fake tier): every lookup is a plain
    attribute read, where torch's ``ThreadLocalWorld`` does a thread-local lookup per
    attribute (a fifth of the fake tier's time at world 1,024 went there).
    """
    world_class = torch_private.world_class()
    probe = world_class()
    fields = tuple(
        name
        for name, attr in vars(world_class).items()
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
    namespace["pg_config_info"] = world_class.pg_config_info  # type: ignore[attr-defined]
    return type("_PrivateWorld", (world_class,), namespace)


@contextmanager
def isolated_world(timeout: float, *, what: str, per_thread: bool = True) -> Iterator[None]:
    """Give the in-process ranks a private torch.distributed world; restore it afterwards.

    ``per_thread``: each thread gets its own world (the threaded tier's concurrent ranks);
    otherwise one private world for ranks that run in turn (the fake tier), which is cheaper.
    """
    import torch
    import torch.distributed as dist

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
        mtpg = torch_private.threaded_pg()

        class _IsolatedWorld(mtpg.ThreadLocalWorld):  # type: ignore[misc,name-defined]
            pg_config_info = torch_private.world_class().pg_config_info  # type: ignore[attr-defined]
    else:
        _IsolatedWorld = _private_world_class()

    saved_world = torch_private.world()
    saved_autograd_mt = torch_private.autograd_multithreading()
    saved_hook = sys.excepthook
    saved_rank = dist.get_rank() if dist.is_initialized() else -1
    _active.inside = True
    try:
        torch_private.set_world(_IsolatedWorld())
        torch_private.thread_isolation(True)
        yield
    finally:
        _active.inside = False
        torch_private.set_world(saved_world)
        torch_private.thread_isolation(False)
        torch_private.set_global_rank(saved_rank)
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
    torch_private.reset_mesh_resources()
    torch_private.reset_dtensor_rng()
    if torch_private.dtensor_loaded():
        torch_private.forget_dtensor_plans()


def leftovers(kept: Any = None) -> list[str]:
    """Distributed state still alive in this thread/process; empty when clean.

    ``kept``: the world process group the caller deliberately keeps (it must be the default
    group and the only one registered).
    """
    import torch.distributed as dist

    found: list[str] = []
    if kept is None and dist.is_initialized():
        found.append("a default process group is still initialised")
    if kept is not None and not (dist.is_initialized() and torch_private.default_group() is kept):
        found.append("the kept world process group is no longer the default group")
    others = [pg for pg in torch_private.world().pg_map if pg is not kept]
    if others:
        found.append(f"{len(others)} process group(s) still registered")
    if torch_private.mesh_stack_entered():
        found.append("a DeviceMesh context (with mesh:) is still entered")
    if torch_private.dtensor_rng_bound():
        found.append("DTensor's RNG tracker is still bound to a mesh")
    return found
