"""The multi-rank harness: ``run(fn, world_size, backend=...)`` on fake, threaded, gloo or nccl.

Importing this package does not import torch; each tier imports it when first used.
"""

from __future__ import annotations

from meshsim.harness.api import (
    BACKENDS,
    DEFAULT_TIMEOUT,
    MAX_FAKE_WORLD_SIZE,
    MAX_WORLD_SIZE,
    run,
)
from meshsim.harness.context import RankContext, context
from meshsim.harness.outcome import RankOutcome, RunResult


def shutdown() -> None:
    """Stop the gloo/nccl worker pool of this process; the next process-tier run starts a new one.

    Also runs at interpreter exit. Leaves no worker process, pipe or temp dir behind.
    """
    from meshsim.harness import pool

    pool.shutdown()


__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "MAX_FAKE_WORLD_SIZE",
    "MAX_WORLD_SIZE",
    "RankContext",
    "RankOutcome",
    "RunResult",
    "context",
    "run",
    "shutdown",
]
