"""The fake tier: the caller's process runs each rank in turn on torch's fake backend.

No communication happens (collectives return at once with garbage data), so the tier checks
metadata: ranks, meshes, groups - and the *order* of calls. Every rank's group creations and
collectives are recorded and compared (``meshsim.harness.divergence``): a mismatch raises
``CollectiveDivergence``, ahead of any rank's failure (a rank that raised counts as cut
short). Between ranks all torch.distributed and DeviceMesh state is reset, so rank r+1 never
sees rank r's groups or meshes. ``timeout`` applies to each rank's body (the ranks stand for
processes that would run concurrently).
"""

from __future__ import annotations

import functools
from typing import Any

from meshsim import torch_private
from meshsim.harness import rank_env, recorder, rng
from meshsim.harness.backend import Job
from meshsim.harness.context import RankContext, rank_context
from meshsim.harness.divergence import Comparison, RankSink
from meshsim.harness.fake_groups import NonMemberFastPath
from meshsim.harness.isolation import isolated_world, reset_rank_state
from meshsim.harness.layout_memo import LayoutMemo
from meshsim.harness.live import with_consequence
from meshsim.harness.outcome import (
    RankOutcome,
    RunResult,
    exception_fields,
    failure_error,
    timeout_error,
)
from meshsim.harness.threadtools import HarnessInterrupt, Watchdog
from meshsim.harness.waits import Waits


class FakeBackend:
    """One process, ranks one after another, ``FakeStore`` + the ``"fake"`` backend."""

    name = "fake"

    def run(self, job: Job) -> RunResult[Any]:
        comparison = Comparison(job.world_size)
        outcomes: list[RankOutcome] = []
        recorder.install()
        fast_path = NonMemberFastPath()
        layout_memo = LayoutMemo()
        watchdog = Watchdog(job.timeout)  # one watching thread for every rank in turn
        try:
            with (
                isolated_world(job.timeout, what="backend='fake'", per_thread=False),
                rng.caller_state_kept(),
                rank_env.in_process_environments("fake"),
            ):
                fast_path.install()
                if fast_path.installed:
                    layout_memo.install()
                try:
                    for rank in job.ranks:
                        reset_rank_state()
                        rng.torch_fresh()  # each rank starts as a new process: torch's seed
                        sink = comparison.begin_rank(rank)
                        outcome = _run_rank(job, rank, sink, watchdog)
                        comparison.end_rank(sink, final=outcome.ok)
                        outcomes.append(outcome)
                        if outcome.status == "timeout":
                            break
                finally:
                    watchdog.close()
                    layout_memo.uninstall()
                    fast_path.uninstall()
                    reset_rank_state()
        finally:
            recorder.uninstall()
        info: dict[str, Any] = {"fn": job.fn, "backend": self.name, "world_size": job.world_size}
        divergence = comparison.divergence(outcomes)  # first, as on every tier
        if divergence is not None:
            if all(o.ok for o in outcomes):
                raise divergence
            ending = "a rank raised or timed out (the fake tier runs ranks in turn)"
            raise with_consequence(divergence, outcomes, ending)
        if outcomes and outcomes[-1].status == "timeout":
            skipped = len(job.ranks) - len(outcomes)
            note = f"(the fake tier runs ranks in turn; {skipped} later rank(s) were not run)"
            # Fake collectives return at once: nobody waits, the report says where ranks are.
            waits = Waits(job.world_size, {}, {}, outcomes)
            raise timeout_error(outcomes, timeout=job.timeout, note=note, waits=waits, **info)
        failure = failure_error(outcomes, **info)
        if failure is not None:
            raise failure
        return RunResult(
            outcomes,
            backend=self.name,
            world_size=job.world_size,
            group_creations=comparison.group_creations(),
            calls=comparison.calls_by_rank(),
        )


def _run_rank(job: Job, rank: int, sink: RankSink, watchdog: Watchdog) -> RankOutcome:
    import torch.distributed as dist

    ctx = RankContext(rank=rank, world_size=job.world_size, backend="fake", device="cpu")
    dist.init_process_group("fake", store=_store(), rank=rank, world_size=job.world_size)
    recorder.set_sink(sink)
    try:
        with rank_context(ctx), rank_env.rank_environment(rank, job.world_size):
            try:
                with watchdog:
                    value = job.fn(*job.args, **job.kwargs)
            except HarnessInterrupt:
                return RankOutcome(
                    rank, status="timeout", stack=watchdog.stack, collective=sink.where()
                )
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                return RankOutcome(rank, status="error", **exception_fields(exc))
        return RankOutcome(rank, value=value)
    finally:
        recorder.set_sink(None)


@functools.cache
def _store_type() -> type:
    """A store whose every operation raises, as torch's ``FakeStore`` did up to 2.14.

    torch 2.15 made ``FakeStore`` a C++ store that answers every ``get`` with empty bytes: a
    real backend asked for on the fake tier (``backend_override={"tp": "gloo"}``) then
    rendezvoused on garbage and crashed the process. With this store it raises, as before.
    """
    import torch.distributed as dist

    torch_private.register_fake_backend()

    return type("FakeStore", (dist.Store,), {})


def _store() -> Any:
    return _store_type()()
