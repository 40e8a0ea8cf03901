"""The sweep's worker processes as the sweep sees them: start, hand out chunks, stream the
answers back, and end, politely at the end of a sweep or at once on a signal.

Every layout is verified in a worker (``meshsim.cli.sweep_remote``), never in the sweep's own
process: the sweep only waits on the workers' connections, so a Ctrl-C or SIGTERM finds it
between answers, and stopping is killing the workers, whatever they were in (torch's import, a
fake batch, a gloo world whose ranks hang). The sweep's process never imports torch.

Workers are plain ``python -c`` processes, each in a session of its own: a terminal's Ctrl-C
reaches the sweep only, and no ``multiprocessing`` pool or resource tracker is involved (the
``ProcessPoolExecutor`` they replace broke on Ctrl-C with ``BrokenProcessPool`` tracebacks
and left its workers and tracker running after SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshsim.cli.sweep_remote import Chunk, Examined
from meshsim.errors import MeshsimError

#: Seconds between looks at the stop flag while no answer arrives (a signal's handler only
#: records it; the wait then runs on to its timeout).
POLL_S = 0.05
#: Seconds at most to read what killed workers had sent (their connections end as they die).
DRAIN_S = 5.0
#: Seconds a worker gets to leave after ``exit`` (its gloo pool stops first) before it is
#: killed.
EXIT_WAIT_S = 30.0

_BOOT = (
    "import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from meshsim.cli.sweep_remote import main; main(int(sys.argv[1]))"
)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SweepWorkerError(MeshsimError, RuntimeError):
    """A sweep worker failed outside any layout (a bug, or it was killed from outside)."""


class _Worker:
    """One worker process and the sweep's end of its connection."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps([_PACKAGE_ROOT])],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=2,  # stdout may carry `--json -`: anything a worker prints goes to stderr
            start_new_session=True,
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    def send(self, *message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message))

    def recv(self) -> tuple[Any, ...]:
        try:
            return pickle.loads(self.conn.recv_bytes())  # type: ignore[no-any-return]
        except (EOFError, OSError) as exc:
            code = self.proc.poll()
            how = "is still running" if code is None else f"exited with {code}"
            raise SweepWorkerError(
                f"sweep worker {self.proc.pid} closed its connection and {how}"
            ) from exc

    def kill(self) -> None:
        """SIGKILL it and all below it, unless it has ended and been reaped (its pid may then
        be another process's). What it sent before stays readable on the connection."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)

    def reap(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.conn.close()


class Workers:
    """Up to ``jobs`` workers, started when a step first needs them and kept for the next."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self.started: list[_Worker] = []

    def run(
        self,
        chunks: Sequence[Chunk],
        stop: Callable[[], bool],
        *,
        parallel: bool,
        tick: Callable[[], None] | None = None,
    ) -> Iterator[tuple[int, int, Examined]]:
        """(chunk index, index in the chunk, answer) as answers arrive, until every chunk is
        done or ``stop()`` holds; then the answers already received, and no more.

        ``parallel``: chunks go to up to ``jobs`` workers at once (the fake and threaded
        tiers, which run in one process), else all to one worker (a gloo or nccl world
        takes the machine's ranks). ``tick`` is called at least every ``POLL_S`` while
        answers are awaited (the sweep's progress lines).
        """
        wanted = min(self.jobs if parallel else 1, len(chunks))
        while len(self.started) < wanted:
            self.started.append(_Worker())
        idle = deque(self.started[:wanted])
        waiting = deque(enumerate(chunks))
        busy: dict[Any, _Worker] = {}
        while waiting or busy:
            if stop():
                for worker in self.started:
                    worker.kill()  # first: the answers they sent stay readable
                yield from self._received(busy)
                return
            while idle and waiting:
                worker = idle.popleft()
                number, chunk = waiting.popleft()
                worker.send("chunk", number, chunk)
                busy[worker.conn] = worker
            if tick is not None:
                tick()
            for worker in self._ready(busy, POLL_S):
                message = worker.recv()
                if message[0] == "cases":
                    yield from ((message[1], index, answer) for index, answer in message[2])
                elif message[0] == "done":
                    del busy[worker.conn]
                    idle.append(worker)
                else:
                    raise SweepWorkerError(f"a sweep worker failed:\n{message[2]}")

    def _received(self, busy: dict[Any, _Worker]) -> Iterator[tuple[int, int, Examined]]:
        """The answers the killed workers had sent: read up to the end of each connection
        (a message cut short by the kill is dropped)."""
        deadline = time.monotonic() + DRAIN_S
        while busy and time.monotonic() < deadline:
            for worker in self._ready(busy, max(0.0, deadline - time.monotonic())):
                try:
                    message = worker.recv()
                except SweepWorkerError:
                    message = ("gone",)
                if message[0] == "cases":
                    yield from ((message[1], index, answer) for index, answer in message[2])
                else:  # its chunk is over (done, failed or gone): nothing more to read
                    del busy[worker.conn]

    @staticmethod
    def _ready(busy: dict[Any, _Worker], timeout: float) -> list[_Worker]:
        from multiprocessing.connection import wait

        return [busy[conn] for conn in wait(list(busy), timeout)] if busy else []

    def close(self, stop: Callable[[], bool]) -> None:
        """Ask each worker to leave (its gloo pool stops with it); kill any that lingers past
        ``EXIT_WAIT_S``, and all at once if ``stop()`` turns true meanwhile."""
        workers, self.started = self.started, []
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.send("exit")
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline and not stop():
            if all(worker.proc.poll() is not None for worker in workers):
                break
            time.sleep(POLL_S)
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.reap()

    def kill(self) -> None:
        """End every worker now, with every process it started: the stop of a sweep."""
        workers, self.started = self.started, []
        for worker in workers:
            worker.kill()
        for worker in workers:  # all killed first: they die side by side
            worker.reap()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it.

    Each process is stopped (SIGSTOP) before its children are read, so none forks a child
    that is missed, and all are killed together at the end. A process group would not do: the
    gloo tier's rank processes live in sessions of their own. Where ``/proc`` lists no
    children (not Linux), the worker's own session is killed, and the rank processes, which
    exit when their parent goes, follow within half a second.
    """
    found: list[int] = []
    frontier = [pid]
    while frontier:
        for each in frontier:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(each, signal.SIGSTOP)
        found += frontier
        frontier = [c for each in frontier for c in children(each) if c not in found]
    # A child forked while its parent took the SIGSTOP: look once more.
    found += [c for each in list(found) for c in children(each) if c not in found]
    if not os.path.isdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for each in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signal.SIGKILL)


def children(pid: int) -> list[int]:
    """``pid``'s child processes, from ``/proc`` ([] where it lists none)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    return pids
