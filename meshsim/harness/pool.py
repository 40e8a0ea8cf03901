"""The warm pool of worker processes (torch already imported) shared by the gloo/nccl tiers.

Workers are never forked from the caller (it may hold torch threads or CUDA). By default they
are forked from a *template*: one fresh interpreter (``python -c``, its own session) that
imports torch once, runs nothing, and forks a worker per request; importing torch is most of a
worker's boot, so N workers cost one import instead of N (``MESHSIM_POOL_BOOT=spawn``: one
fresh interpreter per worker, as before). A gloo worker sees no GPU (``CUDA_VISIBLE_DEVICES``
empty from its start, so the CUDA driver never sees one): the tier stands in for CPU machines,
and a framework that finds a GPU would put rank r on ``cuda:r``, or torch would give a
whole-world mesh dim a new group where an nccl run shares the default one. nccl workers are
started apart, with the caller's GPUs. Workers run in their own session and talk to the
parent over a socketpair (no TCP). They boot in parallel and in the background; a run waits
only for the workers it needs. A worker is reused only if it
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
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from meshsim import options, torch_private
from meshsim.errors import MeshsimError
from meshsim.harness import rendezvous, stopping
from meshsim.harness.outcome import death_cause, signal_name

#: Seconds a new worker may take to import torch (env ``MESHSIM_BOOT_TIMEOUT``).
BOOT_TIMEOUT_S = options.environment("MESHSIM_BOOT_TIMEOUT", strict=False)
#: Idle workers kept between runs (env ``MESHSIM_POOL_SIZE``).
POOL_SIZE = int(options.environment("MESHSIM_POOL_SIZE", strict=False))

#: How workers start (env ``MESHSIM_POOL_BOOT``): ``template`` forks them from one process
#: that imported torch once; ``spawn`` starts a fresh interpreter per worker.
BOOT_MODE = os.environ.get("MESHSIM_POOL_BOOT") or "template"

_BOOT = (
    "import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from meshsim.harness.worker import main; main(int(sys.argv[1]))"
)
_TEMPLATE_BOOT = (
    "import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from meshsim.harness.pool import template_main; template_main(int(sys.argv[1]))"
)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


#: Set in a worker's environment when it may see the caller's GPUs (an nccl worker).
GPUS_ENV = "MESHSIM_WORKER_GPUS"


def _popen(code: str, fd: int, log_path: str, gpus: bool = False) -> subprocess.Popen:
    """A fresh interpreter in its own session running ``code`` with ``fd``, output to a log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(GPUS_ENV, None)
    if gpus:
        env[GPUS_ENV] = "1"
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(fd), json.dumps([_PACKAGE_ROOT])],
            pass_fds=[fd],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


class Worker:
    """One worker process as the parent sees it."""

    def __init__(
        self, pool_dir: str, index: int, template: Template | None = None, gpus: bool = False
    ) -> None:
        from multiprocess.connection import Connection

        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log_path = os.path.join(pool_dir, f"worker-{index}.log")
        #: Whether this worker sees the caller's GPUs (nccl) or none (gloo).
        self.gpus = gpus
        self.proc: Any
        if template is None:
            self.proc = _popen(_BOOT, child_sock.fileno(), self.log_path, gpus)
        else:
            self.proc = template.fork(child_sock, self.log_path, gpus)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.template = template
        self.ready = False
        self.log_offset = 0
        #: The kept world process group this worker holds: (world id, key), or None.
        self.world: tuple[int, tuple] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        self.signal_kill()
        self.reap()

    def signal_kill(self) -> None:
        """SIGKILL the worker and its session, without waiting for it to die."""
        if self.proc.poll() is None and self.proc.pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)  # forked, not yet its own session leader

    def reap(self) -> None:
        if self.proc.pid > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state)
                self.proc.wait(10)
        self.conn.close()

    def alive(self) -> bool:
        return self.proc.poll() is None


def kill_all(workers: Iterable[Worker]) -> None:
    """SIGKILL every worker, then reap them: killed one after another, eight ranks holding a
    framework's model took 0.5 s to die in a row, most of a Ctrl-C's 2 s."""
    workers = list(workers)
    for worker in workers:
        worker.signal_kill()
    for worker in workers:
        worker.reap()


class _ForkedProc:
    """A worker forked by the template, with the part of ``subprocess.Popen`` the pool uses.

    The template is its parent and reaps it; it writes the exit code (negative: the signal) to
    ``status_path``. The pid arrives from the template once it has forked (``pid`` waits).
    """

    def __init__(self, template: Template, status_path: str) -> None:
        self._template = template
        self._pid: int | None = None
        self.status_path = status_path
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._template.settle(self)
        return self._pid if self._pid is not None else -1

    def poll(self) -> int | None:
        """The exit code once known: from the template's file, or read off the zombie.

        A worker that exited is a zombie until the template reaps it; its wait status is in
        ``/proc/<pid>/stat``, so the answer does not wait for the template to be scheduled.
        """
        if self.returncode is None:
            self.returncode = self._read_status()
        if self.returncode is None and self.pid > 0 and _zombie_status(self.pid) is not None:
            self.returncode = _zombie_status(self.pid)
        if self.returncode is None and (self.pid < 0 or not _exists(self.pid)):
            time.sleep(0.05)  # reaped a moment ago: the template writes the file next
            self.returncode = self._read_status()
            if self.returncode is None:  # never forked, or its reaper (the template) died
                self.returncode = -signal.SIGKILL
        return self.returncode

    def _read_status(self) -> int | None:
        try:
            with open(self.status_path) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"meshsim worker {self._pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


def _zombie_status(pid: int) -> int | None:
    """The exit code of ``pid`` if it is a zombie (``exit_code``, field 52 of its stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Template:
    """The process that imported torch once and forks the pool's workers (see the module doc).

    Requests go over a ``SOCK_SEQPACKET`` socketpair, each carrying the worker's end of its
    socketpair; the template answers each with the new worker's pid, in request order. It
    starts in the background: requests queue until it has imported torch.
    """

    def __init__(self, pool_dir: str) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path = os.path.join(pool_dir, "template.log")
        self.dir = pool_dir
        self.proc = _popen(_TEMPLATE_BOOT, child_sock.fileno(), self.log_path)
        child_sock.close()
        self.sock = parent_sock
        self.pending: deque[_ForkedProc] = deque()
        self.count = 0
        self.lock = threading.Lock()

    def fork(self, worker_sock: socket.socket, log_path: str, gpus: bool) -> _ForkedProc:
        """Ask for a worker serving ``worker_sock``; its pid is read later (``settle``)."""
        with self.lock:
            self.count += 1
            proc = _ForkedProc(self, os.path.join(self.dir, f"status-{self.count}"))
            request = json.dumps(
                {"log": log_path, "status": proc.status_path, "gpus": gpus}
            ).encode()
            try:
                socket.send_fds(self.sock, [request], [worker_sock.fileno()])
            except OSError:
                proc._pid = -1  # the template is gone: the worker never starts (EOF at boot)
                return proc
            self.pending.append(proc)
            return proc

    def settle(self, proc: _ForkedProc) -> None:
        """Read the template's answers up to ``proc``'s pid (waiting for it to fork)."""
        with self.lock:
            while proc._pid is None and self.pending:
                first = self.pending[0]
                ready, _, _ = select.select([self.sock], [], [], BOOT_TIMEOUT_S)
                data = self.sock.recv(16) if ready else b""
                self.pending.popleft()
                first._pid = struct.unpack("!i", data)[0] if len(data) == 4 else -1
            if proc._pid is None:
                proc._pid = -1

    def close(self) -> None:
        """End the template (its workers are the pool's business) and reap it."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def template_main(fd: int) -> None:
    """Entry point of the template process: import torch once, then fork workers on request.

    Nothing runs here but imports: no torch op, no process group, no thread of ours, so a
    fork starts from the state a fresh interpreter has after ``import torch``.
    """
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import dill  # noqa: F401

    torch_private.preload()

    import meshsim.harness.worker  # noqa: F401

    parent = os.getppid()
    children: dict[int, str] = {}
    wake_r, wake_w = socket.socketpair()  # SIGCHLD wakes the loop: exits are reported at once
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while os.getppid() == parent:
        ready, _, _ = select.select([sock, wake_r], [], [], 0.5)
        with contextlib.suppress(OSError):
            wake_r.recv(4096)
        _reap(children)
        if sock not in ready:
            continue
        try:
            request, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except OSError:
            break
        if not request:
            break  # the pool closed the socket
        spec = json.loads(request)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            wake_r.close()
            wake_w.close()
            _forked_worker(sock, fds[0], spec["log"], spec["gpus"])
        os.close(fds[0])
        children[pid] = spec["status"]
        with contextlib.suppress(OSError):
            sock.send(struct.pack("!i", pid))
    os._exit(0)


def _forked_worker(template_sock: socket.socket, fd: int, log_path: str, gpus: bool) -> None:
    """In the fork: own session, output to the worker's log, then the worker's main loop."""
    from meshsim.harness.worker import main

    if gpus:
        os.environ[GPUS_ENV] = "1"
    template_sock.close()
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    main(fd)  # ends with os._exit


def _reap(children: dict[int, str]) -> None:
    """Collect exited workers and write each one's exit code where the pool reads it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


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
        self.template: Template | None = None

    def spawn(self, gpus: bool = False) -> Worker:
        self.count += 1
        worker = Worker(self.dir, self.count, self._template(), gpus)
        self.booting.append(worker)
        return worker

    def _template(self) -> Template | None:
        """The live template to fork workers from (started on first use), or None (spawn)."""
        if BOOT_MODE != "template":
            return None
        if self.template is not None and self.template.proc.poll() is not None:
            self.template.close()  # it died: start another
            self.template = None
        if self.template is None:
            self.template = Template(self.dir)
        return self.template

    def _boot_failure(self, worker: Worker) -> MeshsimError:
        worker.log_offset = 0
        output = worker.output(4000)
        if worker.template is not None and worker.proc.pid < 0:
            with open(worker.template.log_path, "rb") as f:
                output += f.read()[-4000:].decode("utf-8", "replace")
        cause = worker.describe_death() if not worker.alive() else "did not report ready"
        worker.kill()
        return MeshsimError(
            f"a meshsim worker process failed to start ({cause}). Its output:\n{output}\n"
            "Workers run `python -c 'from meshsim.harness.worker import main'` with this "
            "interpreter; check that torch, dill and multiprocess import there."
        )

    def acquire(self, n: int, key: tuple | None = None, gpus: bool = False) -> list[Worker]:
        """``n`` ready workers in rank order, starting and waiting for new ones as needed.

        With ``key``, workers still holding a kept world of that key (same size, backend,
        timeout, relevant env) come back together, so their process group can be reused.
        ``gpus``: workers that see the caller's GPUs (nccl) rather than none (gloo).
        """
        from multiprocess.connection import wait

        with self.lock:
            for dead in [w for w in self.idle if not w.alive()]:
                self._forget_world(dead)
                self.idle.remove(dead)
            idle = [w for w in self.idle if w.gpus == gpus]
            booting = [w for w in self.booting if w.gpus == gpus]
            for _ in range(n - len(idle) - len(booting)):
                self.spawn(gpus)
            deadline = time.monotonic() + BOOT_TIMEOUT_S
            while sum(w.gpus == gpus for w in self.idle) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._boot_failure(next(w for w in self.booting if w.gpus == gpus))
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
            return self._take(n, key, gpus)

    def _take(self, n: int, key: tuple | None, gpus: bool) -> list[Worker]:
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
        self.idle.sort(key=lambda w: (w.gpus != gpus, w.world is not None))
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
            kill_all(broken)
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
            if stopping.requested():
                return  # Ctrl-C or SIGTERM: no replacements for a process about to end
            for worker in broken[: max(0, keep - len(self.idle) - len(self.booting))]:
                self.spawn(worker.gpus)

    def pids(self) -> list[int]:
        """Pids of the idle and booting workers, and of the template they are forked from."""
        with self.lock:
            template = [self.template.proc.pid] if self.template is not None else []
            return [w.pid for w in self.idle + self.booting] + template

    def close(self) -> None:
        with self.lock:
            workers, self.idle, self.booting = self.idle + self.booting, [], []
            template, self.template = self.template, None
        for worker in workers:
            if worker.ready:
                with contextlib.suppress(OSError):
                    worker.send("exit")
        # still booting: it reads no "exit", so waiting for it would take the 5 s
        kill_all(w for w in workers if not w.ready)
        deadline = time.monotonic() + 5
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            worker.kill()
        if template is not None:
            template.close()
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
    """Pids of this process's idle and booting workers and their template (tests, diagnostics)."""
    pool = _pool
    return pool.pids() if pool is not None and pool.pid == os.getpid() else []
