"""Inside a torchrun job: run the body once in this process on the job's own default group.

Detected from ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` (what torchrun and most launchers
set). Only the process tiers (gloo, nccl) defer to the job; fake and threaded are simulations
and always run locally. Every rank's outcome is gathered with ``all_gather_object`` so all
ranks return the same list or raise the same ``RankFailure``. A hang cannot be killed from
inside the job: a faulthandler watchdog dumps every thread's stack and exits the process at
the deadline, which makes torchrun tear the job down.

When no default group exists yet, the first run initialises it from ``env://`` and keeps it
for later runs, destroying it at interpreter exit: re-initialising ``env://`` on the same
``MASTER_PORT`` in one process races with the previous store (a rank can read its peer's
stale gloo address and fail with "Connection refused").
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
from datetime import timedelta
from typing import Any

from meshsim.errors import UsageError
from meshsim.harness import pickling
from meshsim.harness.backend import Job
from meshsim.harness.context import RankContext, rank_context
from meshsim.harness.outcome import RankOutcome, RunResult, exception_fields, failure_error

#: Seconds past the timeout before the watchdog kills a hung rank (the gather needs time).
WATCHDOG_SLACK_S = 30.0


def _destroy(group: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


def detected() -> bool:
    """True inside a launched job (torchrun, or anything setting the same variables)."""
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def run_in_place(job: Job) -> RunResult[Any]:
    """Run ``job`` as this process's rank of the surrounding job."""
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    if job.world_size != env_world:
        raise UsageError(
            f"meshsim.run(world_size={job.world_size}) inside a torchrun job of WORLD_SIZE="
            f"{env_world}; the job's processes are the ranks, so pass world_size={env_world} "
            "(or use backend='fake'/'threaded' to simulate another size in this process)"
        )
    if not dist.is_initialized():
        if job.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            job.backend, init_method="env://", timeout=timedelta(seconds=job.timeout)
        )
        atexit.register(_destroy, dist.group.WORLD)
    rank = dist.get_rank()
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    ctx = RankContext(rank=rank, world_size=env_world, backend=dist.get_backend(), device=device)
    faulthandler.dump_traceback_later(job.timeout + WATCHDOG_SLACK_S, exit=True, file=sys.stderr)
    try:
        with rank_context(ctx, process_wide=True):
            try:
                mine: dict[str, Any] = {
                    "status": "ok",
                    "value": pickling.dumps(job.fn(*job.args, **job.kwargs)),
                }
            except Exception as exc:
                mine = {"status": "error", **exception_fields(exc)}
        gathered: list[Any] = [None] * env_world
        dist.all_gather_object(gathered, mine)
    finally:
        faulthandler.cancel_dump_traceback_later()
    outcomes = []
    for r, res in enumerate(gathered):
        if res["status"] == "ok":
            outcomes.append(RankOutcome(r, value=pickling.loads(res["value"])))
        else:
            fields = {k: res.get(k) for k in ("error_type", "error_message", "traceback")}
            outcomes.append(RankOutcome(r, status="error", **fields))
    failure = failure_error(outcomes, fn=job.fn, backend=job.backend, world_size=env_world)
    if failure is not None:
        raise failure
    return RunResult(outcomes, backend=job.backend, world_size=env_world)
