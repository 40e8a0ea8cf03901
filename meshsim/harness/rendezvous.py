"""Private temp dirs, file stores and hash stores: rendezvous without any TCP port.

Every dir is a fresh ``tempfile.mkdtemp`` named ``meshsim-<pid>-<what>-...`` so parallel
pytest-xdist workers (and parallel jobs) never share a path, and a test can check that its
own process left nothing behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any


def prefix(what: str) -> str:
    """``meshsim-<pid>-<what>-``: the name prefix of this process's temp dirs."""
    return f"meshsim-{os.getpid()}-{what}-"


def make_dir(what: str) -> str:
    """A new private directory (mode 0700) for one job or one pool."""
    return tempfile.mkdtemp(prefix=prefix(what))


def remove_dir(path: str | None) -> None:
    """Remove ``path`` and everything in it; retried because dying ranks may still write."""
    if not path:
        return
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.05)


def leftover_dirs(pid: int | None = None) -> list[str]:
    """Temp dirs of process ``pid`` (default: this one) that still exist."""
    base = tempfile.gettempdir()
    start = f"meshsim-{pid if pid is not None else os.getpid()}-"
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(os.path.join(base, n) for n in names if n.startswith(start))


def sweep_stale() -> list[str]:
    """Remove temp dirs left by meshsim processes that no longer exist (killed hard, no atexit).

    A dir whose pid is alive is kept, even if that pid now belongs to another program.
    """
    base = tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "meshsim" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        remove_dir(os.path.join(base, name))
        removed.append(name)
    return removed


def file_store_path(job_dir: str) -> str:
    """Where the job's ``FileStore`` lives."""
    return os.path.join(job_dir, "store")


def file_store(job_dir: str, world_size: int) -> Any:
    """The job's ``torch.distributed.FileStore`` (called inside each rank's process)."""
    import torch.distributed as dist

    return dist.FileStore(file_store_path(job_dir), world_size)


def hash_store() -> Any:
    """An in-memory store shared by the threads of the threaded tier."""
    import torch.distributed as dist

    return dist.HashStore()
