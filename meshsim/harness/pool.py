"""The warm pool of worker processes (torch already imported) shared by the gloo/nccl tiers.

Workers are fresh interpreters (``python -c``, not fork: the caller may hold torch threads)
started in their own session, talking over a socketpair (no TCP). They boot in parallel and
in the background; a run waits only for the workers it needs. A worker is reused only if it
reported a clean state after its job; a worker that died, was killed or leaked state is
replaced at once so the pool stays warm. One pool per process (a forked child or a
pytest-xdist worker gets its own); ``shutdown()`` and interpreter exit stop it and remove its
temp dir. Each worker's output goes to a log file; the slice written during a job is
forwarded to the caller's stderr (``[rank N] ...``) and quoted when a rank dies.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from meshsim.errors import MeshsimError
from meshsim.harness import rendezvous
from meshsim.harness.outcome import death_cause, signal_name

#: Seconds a new worker may take to import torch (env ``MESHSIM_BOOT_TIMEOUT``).
BOOT_TIMEOUT_S = float(os.environ.get("MESHSIM_BOOT_TIMEOUT") or 120)
#: Idle workers kept between runs (env ``MESHSIM_POOL_SIZE``).
POOL_SIZE = int(os.environ.get("MESHSIM_POOL_SIZE") or 8)

_BOOT = (
    "import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from meshsim.harness.worker import main; main(int(sys.argv[1]))"
)


class Worker:
    """One worker process as the parent sees it."""

    def __init__(self, pool_dir: str, index: int) -> None:
        from multiprocess.connection import Connection

        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log_path = os.path.join(pool_dir, f"worker-{index}.log")
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child_sock.fileno()), json.dumps([package_root])],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.pid = self.proc.pid
        self.ready = False
        self.log_offset = 0
        #: The kept world process group this worker holds: (world id, key), or None.
        self.world: tuple[int, tuple] | None = None

    def send(self, *msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg))

    def recv(self) -> tuple:
        """The next message; ``EOFError`` once the worker is gone."""
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (OSError, pickle.UnpicklingError) as exc:  # a dying worker's torn message
            raise EOFError(str(exc)) from exc

    def mark_log(self) -> None:
        self.log_offset = os.path.getsize(self.log_path)

    def output(self, limit: int = 16384) -> str:
        """What the worker printed since ``mark_log`` (the tail, at most ``limit`` bytes)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                start = max(self.log_offset, f.tell() - limit)
                f.seek(start)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def status(self, wait: float = 5.0) -> tuple[int | None, str | None]:
        """(exit code, signal name) once the process has ended (killing it if it lingers)."""
        try:
            code = self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            return None, signal_name(-code)
        return code, None

    def describe_death(self) -> str:
        code, sig = self.status()
        return death_cause(code, sig)

    def kill(self) -> None:
        """SIGKILL the worker and anything it started (its session), then reap it."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
                self.proc.wait(10)
        self.conn.close()

    def alive(self) -> bool:
        return self.proc.poll() is None


class Pool:
    def __init__(self) -> None:
        self.pid = os.getpid()
        rendezvous.sweep_stale()
        self.dir = rendezvous.make_dir("pool")
        self.idle: list[Worker] = []
        self.booting: list[Worker] = []
        self.count = 0
        #: Kept worlds: id -> its workers in rank order (see ``take``).
        self.worlds: dict[int, list[Worker]] = {}
        self.world_count = 0
        self.job_lock = threading.Lock()
        self.lock = threading.Lock()

    def spawn(self) -> Worker:
        self.count += 1
        worker = Worker(self.dir, self.count)
        self.booting.append(worker)
        return worker

    def _boot_failure(self, worker: Worker) -> MeshsimError:
        worker.log_offset = 0
        output = worker.output(4000)
        cause = worker.describe_death() if not worker.alive() else "did not report ready"
        worker.kill()
        return MeshsimError(
            f"a meshsim worker process failed to start ({cause}). Its output:\n{output}\n"
            "Workers run `python -c 'from meshsim.harness.worker import main'` with this "
            "interpreter; check that torch, dill and multiprocess import there."
        )

    def acquire(self, n: int, key: tuple | None = None) -> list[Worker]:
        """``n`` ready workers in rank order, starting and waiting for new ones as needed.

        With ``key``, workers still holding a kept world of that key (same size, backend,
        timeout, relevant env) come back together, so their process group can be reused.
        """
        from multiprocess.connection import wait

        with self.lock:
            for dead in [w for w in self.idle if not w.alive()]:
                self._forget_world(dead)
                self.idle.remove(dead)
            for _ in range(n - len(self.idle) - len(self.booting)):
                self.spawn()
            deadline = time.monotonic() + BOOT_TIMEOUT_S
            while len(self.idle) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._boot_failure(self.booting[0])
                for conn in wait([w.conn for w in self.booting], timeout=left):
                    worker = next(w for w in self.booting if w.conn is conn)
                    self.booting.remove(worker)
                    try:
                        msg = worker.recv()
                    except EOFError:
                        raise self._boot_failure(worker) from None
                    if msg[0] != "ready":
                        raise self._boot_failure(worker)
                    worker.ready = True
                    self.idle.append(worker)
            return self._take(n, key)

    def _take(self, n: int, key: tuple | None) -> list[Worker]:
        """``n`` idle workers in rank order: a kept world of the same ``key`` if one is whole."""
        if key is not None:
            for wid, members in self.worlds.items():
                if len(members) == n and all(
                    w in self.idle and w.world == (wid, key) for w in members
                ):
                    for w in members:
                        self.idle.remove(w)
                    return list(members)
        # Prefer workers outside any kept world, so other worlds stay whole.
        self.idle.sort(key=lambda w: w.world is not None)
        taken, self.idle = self.idle[:n], self.idle[n:]
        for w in taken:
            self._forget_world(w)
        return taken

    def _forget_world(self, worker: Worker) -> None:
        """``worker`` leaves its kept world, which is then no longer whole for anyone."""
        if worker.world is None:
            return
        for member in self.worlds.pop(worker.world[0], []):
            member.world = None
        worker.world = None

    def new_world(self, workers: list[Worker], key: tuple) -> tuple[int, str]:
        """A fresh world id and the directory of its ``FileStore`` (kept until pool close)."""
        with self.lock:
            self.world_count += 1
            wid = self.world_count
            path = os.path.join(self.dir, f"world-{wid}")
            os.mkdir(path, 0o700)
            self.worlds[wid] = list(workers)
            for w in workers:
                w.world = (wid, key)
            return wid, path

    def release(self, clean: list[Worker], broken: list[Worker], *, kept: bool = False) -> None:
        """Return clean workers; kill broken ones and start their replacements now.

        ``kept``: every rank kept the job's world process group, so it stays whole for reuse;
        otherwise its members forget it (and drop it in their next job).
        """
        with self.lock:
            for worker in broken:
                self._forget_world(worker)
                worker.kill()
            if not kept or broken:
                for worker in clean:
                    self._forget_world(worker)
            self.idle.extend(clean)
            keep = max(POOL_SIZE, len(clean) + len(broken))
            self.idle.sort(key=lambda w: w.world is not None)
            while len(self.idle) > keep:
                surplus = self.idle.pop(0)
                self._forget_world(surplus)
                surplus.kill()
            for _ in range(min(len(broken), keep - len(self.idle) - len(self.booting))):
                self.spawn()

    def pids(self) -> list[int]:
        with self.lock:
            return [w.pid for w in self.idle + self.booting]

    def close(self) -> None:
        with self.lock:
            workers, self.idle, self.booting = self.idle + self.booting, [], []
        for worker in workers:
            if worker.ready:
                with contextlib.suppress(OSError):
                    worker.send("exit")
        deadline = time.monotonic() + 5
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            worker.kill()
        rendezvous.remove_dir(self.dir)


_pool: Pool | None = None
_pool_lock = threading.Lock()
_atexit_registered = False


def get_pool() -> Pool:
    """This process's pool (a new one after fork: a child must not drive its parent's)."""
    global _pool, _atexit_registered
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = Pool()
            if not _atexit_registered:
                atexit.register(shutdown)
                _atexit_registered = True
        return _pool


def shutdown() -> None:
    """Stop every worker of this process's pool and remove the pool's temp dir."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.close()


def pool_pids() -> list[int]:
    """Pids of this process's idle and booting workers (for tests and diagnostics)."""
    pool = _pool
    return pool.pids() if pool is not None and pool.pid == os.getpid() else []
