"""``assert_matches_serial``: the N-rank step must compute what the same step computes alone.

Right groups used wrongly train to the end with no error and no hang: a norm gradient not
all-reduced over tp, a loss averaged over dp instead of dp x cp, expert gradients reduced
over the dense group. Replicas then agree with each other, so comparing ranks proves
nothing; comparing with one rank running the same step on the same global batch from the
same weights does. The user's step runs twice, unchanged: on the layout's N ranks and on a
world of one rank (the serial twin), and every logged value, gradient and parameter is
compared, slice by slice, within a tolerance per dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshsim.errors import RankFailure, SerialMismatch, UsageError
from meshsim.usage.compare import Comparison, Kinds, compare
from meshsim.usage.step import StepContext
from meshsim.usage.tensors import RankTrail

#: Backends that move real data (the fake tier only checks metadata).
BACKENDS = ("threaded", "gloo", "nccl")


@dataclass(frozen=True)
class Equivalence:
    """A passing comparison: how much was compared, how closely, and what each run cost."""

    world_size: int
    backend: str
    comparison: Comparison
    seconds: float
    serial_seconds: float

    def __str__(self) -> str:
        c = self.comparison
        return (
            f"the {self.world_size}-rank step on {self.backend} matches the serial step: "
            f"{c.compared} tensors over {c.steps} steps, largest relative difference "
            f"{c.worst:.2g} ({self.seconds:.1f} s, serial {self.serial_seconds:.1f} s)"
        )


def assert_matches_serial(
    step: Callable[[StepContext], Any],
    world_size: int,
    layout: Any,
    *,
    backend: str = "threaded",
    steps: int = 2,
    batch: Callable[[int], Any] | None = None,
    seed: int = 0,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    timeout: float = 120.0,
    **config: Any,
) -> Equivalence:
    """Run ``step(ctx)`` on ``world_size`` ranks and on one; raise if they compute differently.

    ``layout`` is a framework name (with its ``**config``) or a :class:`meshsim.Expected`:
    the groups ``ctx.group(kind)`` hands out and the kinds a finding is explained by. The step
    builds its model from ``torch.manual_seed(ctx.seed)`` (set on every rank before it runs),
    takes ``ctx.batch(i)`` (the global batch ``batch(i)`` returns) and splits it as its own
    loader does, calls ``ctx.record(model, loss=loss, ...)`` once per step after the gradient
    reduction and before the optimizer step, and returns the model. ``steps`` is handed to
    the step as ``ctx.steps``. ``tolerances`` overrides ``(rtol, atol)`` per dtype name.

    Raises :class:`SerialMismatch` (a ``DataflowMismatch``) whose first line names the
    earliest value that differs, the ranks, its relation to the serial value and the likely
    mistake; ``RankFailure`` / ``RankTimeout`` as ``meshsim.run`` does.
    """
    from meshsim.harness import run

    if backend not in BACKENDS:
        raise UsageError(
            f"assert_matches_serial needs real collectives; backend must be one of "
            f"{', '.join(BACKENDS)}, got {backend!r}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be a positive int, got {steps!r}")
    expected = _expected(layout, world_size, config)
    args = (step, world_size, expected, batch, steps, seed)
    start = time.perf_counter()
    trails = list(run(_on_rank, world_size, backend, timeout, args=(*args, False)))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    try:
        (serial,) = run(_on_rank, 1, "threaded", timeout, args=(*args, True))
    except RankFailure as error:
        note = getattr(error, "add_note", None)
        if note is not None:
            note("(in the serial twin: the same step on a world of one rank)")
        raise
    serial_seconds = time.perf_counter() - start
    comparison = compare(trails, serial, _kinds(expected), tolerances)
    if not comparison.passed:
        raise SerialMismatch([f.line for f in comparison.findings], comparison)
    return Equivalence(world_size, backend, comparison, seconds, serial_seconds)


def _expected(layout: Any, world_size: int, config: Mapping[str, Any]) -> Any:
    from meshsim.model.conventions import expect
    from meshsim.model.expected import Expected

    if isinstance(layout, Expected):
        if config:
            raise UsageError("give config keys with a framework name, not with an Expected")
        if layout.world_size != world_size:
            raise UsageError(
                f"the Expected is for world_size={layout.world_size}, not {world_size}"
            )
        return layout
    if not isinstance(layout, str):
        raise UsageError(
            f"layout must be a framework name or a meshsim.Expected, got {type(layout).__name__}"
        )
    return expect(layout, world_size, **config)


#: Which role names a group first when several kinds hold it (the gradient's group first).
_ROLE_ORDER = (
    "gradient_reduce", "data_parallel", "tensor", "context", "expert", "expert_data",
    "pipeline", "embedding", "loss",
)  # fmt: skip


def _kinds(expected: Any) -> Kinds:
    """The kinds a finding may be explained by: the roles' kinds first, then the rest."""
    roles = [expected.roles[r] for r in _ROLE_ORDER if r in expected.roles]
    names = list(dict.fromkeys([*roles, *expected.roles.values(), *expected.primary_kinds()]))
    families = {}
    for name in names:
        try:
            families[name] = [tuple(g) for g in expected.groups(name)]
        except Exception:  # an unavailable kind under this config: nothing to explain with
            continue
    return Kinds(families, expected.roles)


def _on_rank(
    step: Callable[[StepContext], Any],
    world_size: int,
    expected: Any,
    batch: Callable[[int], Any] | None,
    steps: int,
    seed: int,
    serial: bool,
) -> RankTrail:
    import torch
    import torch.distributed as dist

    torch.manual_seed(seed)
    ctx = StepContext(
        rank=dist.get_rank(),
        world_size=1 if serial else world_size,
        serial=serial,
        expected=None if serial else expected,
        batch=batch,
        steps=steps,
        seed=seed,
    )
    if not serial:
        ctx.start_trace()
    try:
        return ctx.trail(step(ctx))
    finally:
        ctx.stop_trace()
