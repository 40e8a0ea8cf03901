"""The gloo tier: one pool worker process per rank, a ``FileStore`` rendezvous, real gloo.

The parent supervises: it collects each rank's result, notices a rank that dies (exit code
or signal, plus its last output), gives the others ``FAILURE_GRACE_S`` to finish after a
failure, and at the deadline asks every live rank for its Python stack (``SIGUSR1`` ->
``faulthandler``) before killing it. A rank that dies *after* its result arrived is a
teardown problem, not a body failure: the values are returned and a ``TeardownWarning`` is
issued.

Every rank appends each call to a file before issuing it (``recorder.StreamSink``), and the
parent reads those files as the run goes. However the run ends - every rank returned, one
crashed on a mismatched collective, all hung - the recordings are judged first
(``live.judge``): a divergence raises ``CollectiveDivergence`` with the crash or hang it
caused attached, so one broken program gets one report, whatever gloo made of it. While the
ranks run, a world that stands still with a proven divergence is stopped at once
(``live.DivergenceWatch``) instead of at its deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
import warnings
from typing import Any

from meshsim.errors import MeshsimError, TeardownWarning
from meshsim.harness import pickling, recorder, rendezvous, stopping
from meshsim.harness.backend import Job
from meshsim.harness.live import DivergenceWatch, ending_of_run, judge, with_consequence
from meshsim.harness.outcome import (
    RankOutcome,
    RunResult,
    failure_error,
    rank_label,
    timeout_error,
    trim_stack_text,
)
from meshsim.harness.pool import Worker, get_pool, kill_all
from meshsim.harness.sites import as_traceback
from meshsim.harness.waits import Waits

#: After the first failing rank, how long the others get to finish before being stopped
#: (ranks that can only wait for the failed one are stopped at once: ``DivergenceWatch``).
FAILURE_GRACE_S = 10.0
#: How long to wait for a stack dump after SIGUSR1 (the dump must stop growing for
#: ``STACK_STILL_S`` first: a preempted worker writes it in pieces).
STACK_WAIT_S = 5.0
STACK_STILL_S = 0.2
#: How often the parent reads the ranks' recordings while they run (``DivergenceWatch``).
TICK_S = 0.2
#: Keep each warm worker's world process group for the next job of the same world when every
#: rank agrees it is clean (see ``meshsim.harness.worker``); ``MESHSIM_KEEP_WORLD=0`` rebuilds
#: it for every job, as before.
KEEP_WORLD = os.environ.get("MESHSIM_KEEP_WORLD", "1") != "0"


class _Rank:
    def __init__(self, rank: int, worker: Worker) -> None:
        self.rank = rank
        self.worker = worker
        self.result: dict[str, Any] | None = None
        self.done = False
        self.problems: list[str] = []
        self.death: str | None = None  # how the process ended, if it did
        self.kept = False  # the worker kept its world process group for the next job
        self.stream: recorder.StreamReader | None = None  # its calls, as it makes them
        self.stopped = False  # still in the body when the harness stopped the run
        self.cut: tuple[int, Any] = (0, None)  # (calls, call it was in) when it was stopped

    @property
    def in_body(self) -> bool:
        return self.result is None and self.death is None

    @property
    def finished(self) -> bool:
        return self.done or self.death is not None


class ProcessBackend:
    """Shared by the gloo and nccl tiers (``name`` is the torch backend)."""

    name = "gloo"
    #: Whether the ranks see the caller's GPUs; gloo's see none, as on a CPU machine.
    gpus = False

    def run(self, job: Job) -> RunResult[Any]:
        payload = pickling.dumps_body(job.fn, job.args, job.kwargs, self.name)
        pool = get_pool()
        if not pool.job_lock.acquire(timeout=job.timeout):
            raise MeshsimError(
                f"another {self.name} run in this process held the worker pool for "
                f"{job.timeout:g} s; process-tier runs in one process take turns"
            )
        try:
            key = _world_key(job, self.name)
            workers = pool.acquire(job.world_size, key, self.gpus)
            ranks = [_Rank(r, w) for r, w in enumerate(workers)]
            job_dir = None
            try:
                first = workers[0].world
                if first is not None and all(w.world == first for w in workers):
                    world = (first[0], os.path.join(pool.dir, f"world-{first[0]}"))
                else:
                    world = pool.new_world(workers, key)
                job_dir = rendezvous.make_dir("job")
                return self._supervise(job, ranks, job_dir, payload, world)
            finally:
                clean = [r.worker for r in ranks if r.done and not r.problems]
                broken = [r.worker for r in ranks if not (r.done and not r.problems)]
                pool.release(clean, broken, kept=all(r.kept for r in ranks))
                rendezvous.remove_dir(job_dir)
        finally:
            pool.job_lock.release()

    # ------------------------------------------------------------------ supervision

    def _supervise(
        self, job: Job, ranks: list[_Rank], job_dir: str, payload: bytes, world: tuple[int, str]
    ) -> Any:
        from multiprocess.connection import wait

        env = dict(os.environ)
        for r in ranks:
            r.stream = recorder.StreamReader(os.path.join(job_dir, f"calls-{r.rank}"))
            r.worker.mark_log()
            self._send_job(
                r,
                {
                    "rank": r.rank,
                    "world_size": job.world_size,
                    "backend": self.name,
                    "dir": job_dir,
                    "timeout": job.timeout,
                    "payload": payload,
                    "env": env,
                    "sys_path": list(sys.path),
                    "cwd": os.getcwd(),
                    "world_id": world[0],
                    "world_dir": world[1],
                    "keep_world": self.name == "gloo" and KEEP_WORLD,
                },
            )
        deadline = time.monotonic() + job.timeout
        grace: float | None = None
        watch = DivergenceWatch(job.world_size)
        diverged = False
        while True:
            pending = [r for r in ranks if not r.finished]
            if not pending:
                break
            if any(r.death for r in ranks) and all(r.result is not None for r in pending):
                break  # the rest only wait in teardown for a rank that is gone
            limit = deadline if grace is None else min(deadline, grace)
            now = time.monotonic()
            if now >= limit or stopping.requested():
                break
            by_conn = {r.worker.conn: r for r in pending}
            for conn in wait(list(by_conn), timeout=min(TICK_S, limit - now)):
                r = by_conn[conn]
                failed = self._receive(r)
                if failed and grace is None:
                    grace = time.monotonic() + FAILURE_GRACE_S
            if watch.look(*_state(ranks)) is not None:
                diverged = True
                break
            if grace is not None and watch.standstill:
                break  # the others wait for the failed rank: nothing left to finish
        stuck = [r for r in ranks if r.in_body]
        on_request = stopping.requested() and any(not r.finished for r in ranks)
        timed_out = bool(stuck) and grace is None and not diverged and not on_request
        status = "timeout" if timed_out else "aborted"
        if on_request:  # Ctrl-C or SIGTERM: nobody reads the stacks, so none is asked for
            for r in ranks:
                r.kept = False  # stopped mid-body: the next job gets a new world
                r.stopped = not r.finished
            kill_all(r.worker for r in ranks if r.stopped)
            raise stopping.stopped(job.fn, job.world_size)
        stopped = self._stop([r for r in ranks if not r.finished], job_dir)
        self._forward_output(ranks)
        outcomes = [self._outcome(r, stopped.get(r.rank), status) for r in ranks]
        info: dict[str, Any] = {"fn": job.fn, "backend": self.name, "world_size": job.world_size}
        calls, blocked = self._recordings(ranks)
        divergence = judge(job.world_size, calls, outcomes, blocked) or watch.found
        if divergence is not None:
            for r in ranks:
                r.kept = False  # the backend may have tolerated it: the next job gets a new world
            if all(o.ok for o in outcomes):
                divergence.outcomes = tuple(outcomes)
                raise divergence
            raise with_consequence(
                divergence, outcomes, ending_of_run(diverged, timed_out, job.timeout)
            )
        if timed_out:
            unfollowed = [r.rank for r in ranks if r.stopped and r.stream.many_threads]  # type: ignore[union-attr]
            waits = Waits(job.world_size, calls, blocked, outcomes, unfollowed=unfollowed)
            raise timeout_error(outcomes, timeout=job.timeout, waits=waits, **info)
        failure = failure_error(outcomes, **info)
        if failure is not None:
            raise failure
        teardown = [o for o in outcomes if o.teardown]
        if teardown:
            warnings.warn(
                TeardownWarning(
                    f"{rank_label(o.rank for o in teardown)} died during teardown after "
                    f"returning ({teardown[0].teardown}); the values are valid, the workers "
                    "were replaced"
                ),
                stacklevel=4,
            )
        return RunResult(
            outcomes, backend=self.name, world_size=job.world_size, teardown_failures=teardown
        )

    def _recordings(self, ranks: list[_Rank]) -> tuple[dict[int, list], dict[int, Any]]:
        """(rank -> its calls, stopped rank -> the call it was in), judged by ``live.judge``.

        Every rank's stream is read to its end first: a killed or crashed rank's file holds
        every call it entered. The backend may have tolerated a mismatch (an ``isend`` nobody
        received, a short message into a larger buffer, two collectives gloo happens to
        pair), hung on it or crashed on it; the recordings tell all three the same way.
        """
        calls: dict[int, list] = {}
        for r in ranks:
            stream = r.stream
            assert stream is not None
            stream.poll()
            if stream.corrupt or (r.result is not None and r.result.get("recording_lost")):
                raise MeshsimError(
                    f"rank {r.rank}'s recording of its calls was lost (a write to its job "
                    "dir failed, e.g. a full disk, or the file is damaged), so the harness "
                    "cannot tell whether the ranks agreed; free space in the temp dir and "
                    "run again"
                )
            # A stopped rank is judged as it was when stopped: killing its peers makes it
            # raise, and what its handlers call then is the harness's doing, not the body's.
            calls[r.rank] = stream.calls[: r.cut[0]] if r.stopped else stream.calls
        blocked = {r.rank: r.cut[1] for r in ranks if r.stopped}
        return calls, blocked

    def _send_job(self, r: _Rank, spec: dict[str, Any]) -> None:
        try:
            r.worker.send("job", spec)
        except OSError:  # the worker died while idle: report it like any death
            r.death = r.worker.describe_death()

    def _receive(self, r: _Rank) -> bool:
        """Handle one message (or EOF) from ``r``; True when it signals a failure."""
        try:
            msg = r.worker.recv()
        except EOFError:
            r.death = r.worker.describe_death()
            return r.result is None
        if msg[0] == "result":
            r.result = msg[1]
            return msg[1]["status"] != "ok"
        if msg[0] == "done":
            r.done = True
            r.problems = list(msg[1])
            r.kept = len(msg) > 2 and bool(msg[2])
        return False

    def _stop(self, live: list[_Rank], job_dir: str) -> dict[int, tuple]:
        """Dump the stacks of ``live`` ranks still in the body, note their collective, kill all."""
        info: dict[int, tuple] = {}
        in_body = [r for r in live if r.result is None]
        for r in in_body:
            r.stopped = True
            r.stream.poll()  # type: ignore[union-attr]
            r.cut = (len(r.stream.calls), r.stream.blocked_in)  # type: ignore[union-attr]
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.worker.pid, signal.SIGUSR1)
        paths = {r.rank: os.path.join(job_dir, f"stack-{r.rank}") for r in in_body}
        end = time.monotonic() + STACK_WAIT_S
        sizes: dict[int, int] = {}
        still_since = time.monotonic()
        while in_body and time.monotonic() < end:
            now_sizes = {k: _size(p) for k, p in paths.items()}
            if now_sizes != sizes or not all(now_sizes.values()):
                sizes, still_since = now_sizes, time.monotonic()
            elif time.monotonic() - still_since >= STACK_STILL_S:
                break
            time.sleep(0.05)
        for r in in_body:
            stack = _read(paths[r.rank]) or "(no stack: the process did not answer SIGUSR1)\n"
            info[r.rank] = (_faulthandler_to_text(stack), r.stream.where())  # type: ignore[union-attr]
        kill_all(r.worker for r in live)  # only now: a killed peer ends the others' collective
        return info

    def _forward_output(self, ranks: list[_Rank]) -> None:
        for r in ranks:
            text = r.worker.output()
            if text.strip():
                prefixed = "".join(f"[rank {r.rank}] {line}" for line in text.splitlines(True))
                sys.stderr.write(prefixed if prefixed.endswith("\n") else prefixed + "\n")

    def _outcome(self, r: _Rank, stopped: tuple | None, status: str) -> RankOutcome:
        outcome = self._outcome_of(r, stopped, status)
        return dataclasses.replace(outcome, pid=r.worker.pid)

    def _outcome_of(self, r: _Rank, stopped: tuple | None, status: str) -> RankOutcome:
        res = r.result
        if res is None:
            if r.death is not None:
                code, sig = r.worker.status()
                output = _tail(trim_stack_text(r.worker.output()))
                return RankOutcome(
                    r.rank, status="died", exit_code=code, signal_name=sig, output=output
                )
            stack, coll = stopped or (None, None)
            return RankOutcome(r.rank, status=status, stack=stack, collective=coll)
        if res["status"] != "ok":
            keys = ("error_type", "error_message", "traceback", "finding")
            fields = {k: res.get(k) for k in keys}
            return RankOutcome(r.rank, status="error", collective=res.get("collective"), **fields)
        teardown = None
        if r.death is not None:
            teardown = f"{r.death}; last output: {_tail(r.worker.output(), 3).strip()}"
        try:
            value = pickling.loads(res.pop("value"))  # its bytes go as the value comes
        except Exception as exc:
            return RankOutcome(
                r.rank,
                status="error",
                error_type=type(exc).__qualname__,
                error_message=f"the caller could not unpickle rank {r.rank}'s return value: {exc}",
            )
        return RankOutcome(r.rank, value=value, teardown=teardown)


def _state(ranks: list[_Rank]) -> tuple[dict[int, list], list[int], dict[int, Any]]:
    """(calls, returned ranks, rank in its body -> the call it is in), for ``DivergenceWatch``.

    Results are read before the streams: a rank's result follows its last recorded call.
    """
    returned = [r.rank for r in ranks if r.result is not None and r.result["status"] == "ok"]
    body = [r for r in ranks if r.in_body]
    for r in ranks:
        r.stream.poll()  # type: ignore[union-attr]
    calls = {r.rank: r.stream.calls for r in ranks}  # type: ignore[union-attr]
    return calls, returned, {r.rank: r.stream.blocked_in for r in body}  # type: ignore[union-attr]


class GlooBackend(ProcessBackend):
    name = "gloo"


#: Environment variables that may change how a process group is set up: a kept world is
#: reused only while these are unchanged.
_PG_ENV_PREFIXES = ("GLOO", "TORCH", "MASTER_", "TP_", "NCCL", "CUDA", "MESHSIM")


def _world_key(job: Job, backend: str) -> tuple:
    """What a kept world process group must match to be reused by ``job``."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_PG_ENV_PREFIXES)))
    return (backend, job.world_size, job.timeout, env)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(text: str, lines: int = 30) -> str:
    return "".join(text.splitlines(True)[-lines:])


def _faulthandler_to_text(dump: str) -> str:
    """The worker's thread stacks from faulthandler, minus the harness's own threads (its
    parent watcher, a graveyard thread freeing an earlier job's groups), in the threaded
    tier's form (``sites.as_traceback``: most recent call last, with source)."""
    blocks = [
        b
        for b in dump.strip().split("\n\n")
        if "_watch_parent" not in b and "graveyard.py" not in b
    ]
    return trim_stack_text(as_traceback("\n\n".join(blocks)))
