"""``meshsim.run``: validate the call, then hand it to the tier that runs it."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any, TypeVar

from meshsim import options, torch_private
from meshsim.errors import UsageError
from meshsim.harness.backend import Backend, Job
from meshsim.harness.outcome import RunResult

T = TypeVar("T")

#: The tiers, cheapest first.
BACKENDS = ("fake", "threaded", "gloo", "nccl")
#: Largest world the threaded/gloo/nccl tiers accept (env ``MESHSIM_MAX_WORLD_SIZE``).
MAX_WORLD_SIZE = int(options.environment("MESHSIM_MAX_WORLD_SIZE", strict=False))
#: Largest world the fake tier accepts (env ``MESHSIM_MAX_FAKE_WORLD_SIZE``).
MAX_FAKE_WORLD_SIZE = int(options.environment("MESHSIM_MAX_FAKE_WORLD_SIZE", strict=False))
#: Seconds a run may take before ``RankTimeout`` (per rank on the fake tier).
DEFAULT_TIMEOUT = 60.0


def _limit(name: str, env: str) -> int:
    """The configured limit: the env var if set, else the (possibly reassigned) attribute."""
    if os.environ.get(env, "").strip():
        return int(options.environment(env))  # a malformed value: a UsageError naming it
    package = sys.modules.get("meshsim.harness")
    value = getattr(package, name, None) if package is not None else None
    return int(value if value is not None else globals()[name])


def _check_world_size(world_size: object, backend: str) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise UsageError(f"world_size must be an int, got {world_size!r}")
    if backend == "fake":
        limit, name = _limit("MAX_FAKE_WORLD_SIZE", "MESHSIM_MAX_FAKE_WORLD_SIZE"), "fake"
        env = "MESHSIM_MAX_FAKE_WORLD_SIZE"
    else:
        limit, name = _limit("MAX_WORLD_SIZE", "MESHSIM_MAX_WORLD_SIZE"), backend
        env = "MESHSIM_MAX_WORLD_SIZE"
    if world_size < 1:
        raise UsageError(f"world_size must be at least 1, got {world_size}")
    if world_size > limit:
        hint = " (or use backend='fake', which only checks metadata)" if backend != "fake" else ""
        raise UsageError(
            f"world_size={world_size} exceeds the {name} tier's maximum of {limit}; raise it "
            f"with the environment variable {env}{hint}"
        )
    return world_size


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise UsageError(f"timeout must be a number of seconds, got {timeout!r}")
    value = float(timeout)
    if not value > 0 or not math.isfinite(value):
        raise UsageError(
            f"timeout must be a positive, finite number of seconds, got {timeout!r}; every "
            "run has a deadline so that a hang becomes a RankTimeout instead of a stuck test"
        )
    return value


def _check_ranks(ranks: Sequence[int] | None, world_size: int, backend: str) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(world_size))
    if backend != "fake":
        raise UsageError(
            f"ranks= selects a sample of ranks and only works with backend='fake'; the "
            f"{backend} tier always runs every rank (drop ranks=, or use backend='fake')"
        )
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        ranks = list(ranks)  # type: ignore[arg-type]
    picked = tuple(ranks)
    if not picked:
        raise UsageError("ranks= is empty; give at least one rank, or omit it for all ranks")
    bad: list[object] = [r for r in picked if isinstance(r, bool) or not isinstance(r, int)]
    bad += [r for r in picked if isinstance(r, int) and not 0 <= r < world_size]
    if bad:
        raise UsageError(f"ranks= must hold ranks in [0, {world_size}), got {bad[:5]!r}")
    if len(set(picked)) != len(picked):
        raise UsageError(f"ranks= lists a rank more than once: {picked!r}")
    return picked


def _backend(name: str) -> Backend:
    if name == "fake":
        from meshsim.harness.fake import FakeBackend

        return FakeBackend()
    if name == "threaded":
        from meshsim.harness.threaded import ThreadedBackend

        return ThreadedBackend()
    if name == "gloo":
        from meshsim.harness.gloo import GlooBackend

        return GlooBackend()
    from meshsim.harness.nccl import NcclBackend

    return NcclBackend()


def run(
    fn: Callable[..., T],
    world_size: int,
    backend: str = "threaded",
    timeout: float = DEFAULT_TIMEOUT,
    *,
    ranks: Sequence[int] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> RunResult[T]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` world; return their values.

    The default process group is initialised on each rank before ``fn`` runs and destroyed
    after; inside ``fn`` use ``torch.distributed.get_rank()`` or
    ``meshsim.harness.context()``. Returns a ``RunResult`` (a ``list``, index = rank, or the
    order of ``ranks=`` on the fake tier). Raises ``RankFailure`` when a rank raises or dies,
    ``RankTimeout`` past ``timeout`` seconds, ``CollectiveDivergence`` (fake, threaded and
    gloo) when ranks issue mismatched collectives or unmatched point-to-point pairs,
    ``NotEnoughGPUs`` (nccl) and ``UsageError`` for bad arguments.

    backend: ``"fake"`` (one process, metadata only, any world size, ``ranks=`` samples),
    ``"threaded"`` (threads, real collectives), ``"gloo"`` (a warm pool of processes),
    ``"nccl"`` (one process per GPU). Inside a torchrun job (``RANK``, ``WORLD_SIZE`` and
    ``MASTER_ADDR`` set) the gloo/nccl tiers run ``fn`` once in this process on the job's
    own default group and gather every rank's value.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; valid backends are: {', '.join(BACKENDS)}")
    if not callable(fn):
        raise UsageError(f"fn must be callable, got {type(fn).__name__}")
    options.check_environment(torch_release=False)  # MESHSIM_POOL_SIZE=abc: named, not ignored
    world_size = _check_world_size(world_size, backend)
    timeout = _check_timeout(timeout)
    picked = _check_ranks(ranks, world_size, backend)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise UsageError(f"kwargs must be a mapping, got {type(kwargs).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise UsageError(f"args must be a sequence (tuple/list), got {type(args).__name__}")
    torch_private.require_supported()
    job = Job(fn, world_size, backend, timeout, picked, tuple(args), dict(kwargs or {}))
    if backend in ("gloo", "nccl"):
        from meshsim.harness import torchrun

        if torchrun.detected():
            return torchrun.run_in_place(job)
    return _backend(backend).run(job)
