"""The per-rank ``RankContext`` a body can read with ``meshsim.harness.context()``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from meshsim.errors import UsageError


@dataclass(frozen=True)
class RankContext:
    """Who this rank is: the same answer on every tier (fake, threaded, gloo, nccl).

    ``device`` is the device the rank should use: ``"cpu"`` except on the nccl tier
    (``"cuda:<local rank>"``).
    """

    rank: int
    world_size: int
    backend: str
    device: str = "cpu"


# Thread-local first (fake and threaded tiers run ranks in threads of one process), then a
# process-wide fallback (a gloo/nccl worker is one rank, so threads the body starts see it).
_local = threading.local()
_process_context: RankContext | None = None


def context() -> RankContext:
    """The ``RankContext`` of the rank running the calling code.

    Raises ``UsageError`` outside a body run by ``meshsim.run``: the rank is meaningless
    there, and a silent default would hide a body that runs in the wrong place.
    """
    ctx = getattr(_local, "ctx", None) or _process_context
    if ctx is None:
        raise UsageError(
            "meshsim.harness.context() was called outside a rank; call it from inside the "
            "function passed to meshsim.run(...)"
        )
    return ctx


@contextmanager
def rank_context(ctx: RankContext, *, process_wide: bool = False) -> Iterator[RankContext]:
    """Make ``ctx`` the current rank for this thread (or the whole process) while inside."""
    global _process_context
    if process_wide:
        previous = _process_context
        _process_context = ctx
    else:
        previous = getattr(_local, "ctx", None)
        _local.ctx = ctx
    try:
        yield ctx
    finally:
        if process_wide:
            _process_context = previous
        else:
            _local.ctx = previous
