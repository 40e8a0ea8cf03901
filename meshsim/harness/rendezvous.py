"""Private temp dirs and the stores ranks meet through.

Every dir is a fresh ``tempfile.mkdtemp`` named ``meshsim-<pid>-<what>-...`` so parallel
pytest-xdist workers (and parallel jobs) never share a path, and a test can check that its
own process left nothing behind.

A gloo world's store is a ``TCPStore`` that rank 0 serves on a port the OS picks, bound to
127.0.0.1 only (:func:`world_store`): torch's ``FileStore`` polls every 10 ms while it waits,
and every group a rank creates waits on its peers' keys, so a warm world-2 test spent half
its time in those sleeps. Where a TCP store cannot be served, the world falls back to a
``FileStore`` in its directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta
from typing import Any

from meshsim.errors import MeshsimError

#: The file in a world's directory that tells ranks 1.. where rank 0 serves the store.
WORLD_PORT_FILE = "store-port"


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


def world_store(world_dir: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """The store of a gloo world: rank 0 serves a ``TCPStore`` on 127.0.0.1 and writes its port
    to the world's directory; the other ranks read it (waiting up to ``timeout_s``) and connect.
    If rank 0 cannot serve one (or env ``MESHSIM_WORLD_STORE=file`` asks), it writes ``file``
    there and every rank uses a ``FileStore``."""
    import torch.distributed as dist

    path = os.path.join(world_dir, WORLD_PORT_FILE)
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store, port = None, "file"
        if os.environ.get("MESHSIM_WORLD_STORE", "tcp") != "file":
            with contextlib.suppress(Exception):  # any refusal: the file store always works
                store, port = _serve(world_size, timeout)
        _write_atomically(path, str(port))
        return store if store is not None else file_store(world_dir, world_size)
    port = _read_when_written(path, timeout_s)
    if port == "file":
        return file_store(world_dir, world_size)
    return dist.TCPStore("127.0.0.1", int(port), world_size, False, timeout)


def _serve(world_size: int, timeout: timedelta) -> tuple[Any, int]:
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, True, timeout,
            wait_for_workers=False, master_listen_fd=listener.fileno(),
        )  # fmt: skip
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the listening socket now
    return store, port


def _write_atomically(path: str, text: str) -> None:
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _read_when_written(path: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise MeshsimError(
                    f"rank 0 did not start the world's store within {timeout_s:g} s "
                    f"({path} was never written)"
                ) from None
            time.sleep(0.002)


def hash_store() -> Any:
    """An in-memory store shared by the threads of the threaded tier."""
    import torch.distributed as dist

    return dist.HashStore()
