"""The threaded tier: one thread per rank on torch's in-process ``"threaded"`` backend.

Real collectives with real data, no processes. Rendezvous is a ``HashStore``. Point-to-point
calls go through an in-process mailbox (``meshsim.harness.mailbox``).

Shared state. torch's threaded backend keeps the world per thread (``ThreadLocalWorld``) and
the C++ group registry per thread (thread-isolation mode); both are swapped in only for the
run (``meshsim.harness.isolation``), so the caller's own process group is untouched.
DeviceMesh's ``_mesh_resources`` is a ``threading.local`` in torch 2.6+ and meshes keep their
flatten mapping and group registry on the root mesh object, so ranks do not share mesh
state; the tests cross-check a mesh workload against the gloo tier to keep that true.
The backend's collective bookkeeping (``ProcessLocalGroup``) is class-level, so threaded
runs in one process take turns.

Hangs. Python cannot kill a thread. At the deadline the harness (1) snapshots every live
rank's stack and the collective it is in, (2) aborts the threaded world, which makes every
rank blocked in a collective raise, (3) raises ``HarnessInterrupt`` asynchronously in the
ranks still running Python code, and (4) joins them with a grace period. A thread stuck in C
code (``time.sleep``, a lock without timeout) survives: it is reported loudly in the
``RankTimeout`` (``survivors``), left as a daemon thread that will not touch torch state
when it wakes, and later threaded runs wait for it (up to their timeout) before starting.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from meshsim import torch_private
from meshsim.errors import MeshsimError
from meshsim.harness import mailbox, rank_env, recorder, rng, stopping, threaded_waits
from meshsim.harness.backend import Job
from meshsim.harness.context import RankContext, rank_context
from meshsim.harness.isolation import isolated_world
from meshsim.harness.live import (
    DivergenceWatch,
    LiveSink,
    LiveTable,
    ending_of_run,
    judge,
    with_consequence,
)
from meshsim.harness.outcome import (
    RankOutcome,
    RunResult,
    exception_fields,
    failure_error,
    rank_label,
    timeout_error,
)
from meshsim.harness.threadtools import HarnessInterrupt, async_raise, thread_stack
from meshsim.harness.waits import Waits

#: After the first failing rank, how long the others get to finish before being stopped
#: (ranks that can only wait for the failed one are stopped at once: ``DivergenceWatch``).
FAILURE_GRACE_S = 10.0
#: How long stopped threads get to unwind after the abort.
JOIN_GRACE_S = 2.0
#: How often the harness looks at the ranks while they run (failures, deadline, deadlocks).
TICK_S = 0.1

_survivors: list[tuple[int, threading.Thread]] = []


class _Rank:
    """One rank thread and what it reported."""

    def __init__(self, run: _Run, rank: int) -> None:
        self.run = run
        self.rank = rank
        self.sink = LiveSink(rank, run.table)
        self.streams = rng.RankStreams()  # this rank's own generators, as a process has them
        self.outcome: RankOutcome | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._main, name=f"meshsim-threaded-rank-{rank}", daemon=True
        )

    def _main(self) -> None:
        import torch.distributed as dist

        run, job = self.run, self.run.job
        ctx = RankContext(rank=self.rank, world_size=job.world_size, backend="threaded")
        recorder.set_sink(self.sink)
        try:
            with (
                rank_context(ctx),
                rng.rank_streams(self.streams),
                rank_env.rank_environment(self.rank, job.world_size),
            ):
                dist.init_process_group(
                    "threaded",
                    rank=self.rank,
                    world_size=job.world_size,
                    store=run.store,
                    timeout=timedelta(seconds=job.timeout),
                )
                value = job.fn(*job.args, **job.kwargs)
            self.report(RankOutcome(self.rank, value=value))
        except HarnessInterrupt:
            where = self.sink.where(job.world_size)
            self.report(RankOutcome(self.rank, status=run.stopping or "timeout", collective=where))
        except SystemExit as exc:
            if torch_private.threaded_world_aborted():  # aborted while we were in a collective
                where = self.sink.raised_where(job.world_size)
                status = run.stopping or "aborted"
                self.report(RankOutcome(self.rank, status=status, collective=where))
            else:
                self.report(RankOutcome(self.rank, status="error", **exception_fields(exc)))
                torch_private.abort_threaded_world()
        except BaseException as exc:
            self.report(RankOutcome(self.rank, status="error", **exception_fields(exc)))
            torch_private.abort_threaded_world()  # wake the ranks waiting for us
        finally:
            recorder.set_sink(None)
            if not run.abandoned:
                try:
                    if dist.is_initialized():
                        dist.destroy_process_group()
                except Exception:
                    pass
            with run.cond:
                run.cond.notify_all()

    def report(self, outcome: RankOutcome) -> None:
        """Keep the first outcome (the harness's ``stopped`` overrides it)."""
        with self.lock:
            if self.outcome is None:
                self.outcome = outcome

    def stopped(self, status: str, where: str | None, stack: str) -> None:
        """The harness stopped this rank: the status and stack are the harness's.

        Where the rank was is its own word when the abort woke it and it said (the call it
        raised out of): a rank already waking when the harness looked is then reported the
        same however the two interleaved. Otherwise it is the harness's snapshot.
        """
        with self.lock:
            own = self.outcome
            if own is not None and own.status in ("timeout", "aborted") and own.collective:
                where = own.collective
            self.outcome = RankOutcome(self.rank, status=status, collective=where, stack=stack)


class _Run:
    def __init__(self, job: Job, store: Any) -> None:
        self.job = job
        self.store = store
        self.abandoned = False
        #: How the harness is ending the run ("timeout" / "aborted"), once it is.
        self.stopping: str | None = None
        self.table = LiveTable(job.world_size)
        self.cond = threading.Condition()
        self.ranks = [_Rank(self, r) for r in range(job.world_size)]
        self.watch = DivergenceWatch(job.world_size)
        self.blocked: dict[int, Any] = {}  # rank -> the call it was in when stopped
        self.cut: dict[int, int] = {}  # rank -> how many calls it had made when stopped

    def alive(self) -> list[_Rank]:
        return [r for r in self.ranks if r.thread.is_alive()]

    def wait(self, deadline: float) -> bool:
        """Until all ranks finish, the deadline, or the failure grace after a failure.

        True when the ranks' recordings already prove a divergence that leaves some of them
        waiting forever: the run is stopped there instead of at the deadline.
        """
        failed_at: float | None = None
        with self.cond:
            while self.alive():
                now = time.monotonic()
                if failed_at is None and any(
                    r.outcome is not None and r.outcome.status == "error" for r in self.ranks
                ):
                    failed_at = now
                limit = (
                    deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
                )
                if now >= limit or stopping.requested():
                    return False
                if self.watch.look(*self.state()) is not None:
                    return True
                if failed_at is not None and self.watch.standstill:
                    return False  # the others wait for the failed rank: nothing left to finish
                self.cond.wait(min(TICK_S, limit - now))
        return False

    def state(self) -> tuple[dict[int, list], list[int], dict[int, Any]]:
        """(calls, returned ranks, running rank -> call it is in), read in a safe order.

        Who returned is read before the calls (a returned rank's calls are then complete),
        and the call a rank is in before its calls (a stale one shows as not blocked).
        """
        returned = [r.rank for r in self.ranks if r.outcome is not None and r.outcome.ok]
        blocked = {r.rank: r.sink.current for r in self.ranks if r.outcome is None}
        calls = {r.rank: list(r.sink.calls) for r in self.ranks}
        return calls, returned, blocked

    def stop(self, status: str) -> tuple[int, ...]:
        """Stop every live rank; returns the ranks whose threads would not stop.

        Every rank still running when the harness looks is reported as stopped with
        ``status`` (``_Rank.stopped``), whatever it does in the grace that follows.
        """
        live = self.alive()
        # What each rank did up to now is what is judged: aborting the world makes the ranks
        # raise, and what their handlers call then is the harness's doing, not the body's.
        self.table.closed = True
        seen: dict[int, tuple[str | None, str]] = {}
        woken = torch_private.threaded_world_aborted()  # by a failed rank, before this stop
        for r in live:
            if r.outcome is None:
                call, where = r.sink.snapshot(self.job.world_size, woken=woken)
                self.blocked[r.rank] = call
                self.cut[r.rank] = len(r.sink.calls)
                seen[r.rank] = (where, thread_stack(r.thread.ident))
        if not live:
            return ()
        self.stopping = status
        torch_private.abort_threaded_world()
        deadline = time.monotonic() + JOIN_GRACE_S
        for r in live:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        for r in live:
            if r.thread.is_alive():
                async_raise(r.thread.ident)
        deadline = time.monotonic() + JOIN_GRACE_S
        for r in live:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        for r in live:
            if r.rank in seen:
                r.stopped(status, *seen[r.rank])
        stuck = tuple(r.rank for r in live if r.thread.is_alive())
        if stuck:
            self.abandoned = True
            _survivors.extend((r.rank, r.thread) for r in live if r.thread.is_alive())
        return stuck


def _wait_for_survivors(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for _, thread in list(_survivors):
        thread.join(max(0.0, deadline - time.monotonic()))
    _survivors[:] = [(r, t) for r, t in _survivors if t.is_alive()]
    if _survivors:
        stacks = "\n".join(f"--- {t.name} ---\n{thread_stack(t.ident)}" for _, t in _survivors)
        raise MeshsimError(
            f"{rank_label(r for r, _ in _survivors)} of an earlier threaded run could not be "
            f"stopped and are still alive after waiting {timeout:g} s; threaded runs in this "
            f"process are unsafe until they exit. Restart the interpreter, or use "
            f"backend='gloo' (processes can be killed).\n{stacks}"
        )


class ThreadedBackend:
    """``world_size`` threads in this process on the ``"threaded"`` backend."""

    name = "threaded"

    def run(self, job: Job) -> RunResult[Any]:
        import torch.distributed as dist

        _wait_for_survivors(job.timeout)
        plg = torch_private.threaded_pg().ProcessLocalGroup
        mailbox.install(plg)  # point-to-point, which torch's threaded backend lacks
        threaded_waits.install(torch_private.threaded_pg())  # abortable, out of the RNG lock
        torch_private.settle_cuda_device_guard()  # before rank threads race to (torch 2.10)
        recorder.install()
        survivors: tuple[int, ...] = ()
        timed_out = diverged = False
        try:
            with (
                isolated_world(job.timeout, what="backend='threaded'"),
                rng.threads_draw_apart(),
                rank_env.in_process_environments("threaded"),
            ):
                plg.reset()
                mailbox.reset()
                run = _Run(job, dist.HashStore())
                deadline = time.monotonic() + job.timeout
                on_request = stopped = False
                try:
                    for r in run.ranks:
                        r.thread.start()
                    diverged = run.wait(deadline)
                    on_request = not diverged and bool(run.alive()) and stopping.requested()
                    timed_out = not diverged and bool(run.alive()) and time.monotonic() >= deadline
                    timed_out = timed_out and not on_request
                    survivors, stopped = run.stop("timeout" if timed_out else "aborted"), True
                finally:
                    if not stopped:  # the wait itself raised (Ctrl-C): no rank outlives the run
                        run.stop("aborted")
                    plg.reset()
                    mailbox.reset()
        finally:
            recorder.uninstall()
        if on_request:
            raise stopping.stopped(job.fn, job.world_size)
        outcomes = [r.outcome or RankOutcome(r.rank, status="aborted") for r in run.ranks]
        info: dict[str, Any] = {"fn": job.fn, "backend": self.name, "world_size": job.world_size}
        # The recordings are judged first, however the run ended (hook: the same comparison
        # as the fake tier's, on final and cut-short recordings alike).
        calls = {r.rank: r.sink.calls[: run.cut.get(r.rank)] for r in run.ranks}
        divergence = judge(job.world_size, calls, outcomes, run.blocked)
        divergence = divergence or run.watch.found or run.table.divergence
        if divergence is not None:
            if all(o.ok for o in outcomes):
                divergence.outcomes = tuple(outcomes)
                raise divergence
            ending = ending_of_run(diverged, timed_out, job.timeout)
            raise with_consequence(divergence, outcomes, ending)
        if timed_out:
            raise timeout_error(
                outcomes,
                timeout=job.timeout,
                survivors=survivors,
                waits=Waits(job.world_size, calls, run.blocked, outcomes),
                **info,
            )
        failure = failure_error(outcomes, **info)
        if failure is not None:
            raise failure
        return RunResult(outcomes, backend=self.name, world_size=job.world_size)
