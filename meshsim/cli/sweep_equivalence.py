"""``meshsim sweep ... --equivalence``: after the group check, each layout's training step.

Every layout whose groups passed trains on the N ranks and alone, from the same weights on the
same global batch (:func:`meshsim.usage.recipe.check_equivalence`): meshsim's recipe on the
framework's meshes, or, with ``--real``, the framework's own step where meshsim runs it
(``meshsim.own_steps``). A layout the step does not run is kept with the reason, never
counted as passed. Steps run one after another in this process (each already spreads its ranks
over the cores), on the sweep's backend where it moves data, else threaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshsim.errors import RunStopped, UsageError
from meshsim.own_steps import STEPS

HELP = (
    "after the group check, train each layout whose groups passed on the N ranks and on one, "
    "from the same weights on the same global batch, and compare every gradient, parameter "
    "and logged value (meshsim's recipe; with --real, the framework's own step where meshsim "
    f"runs it: {', '.join(STEPS)}, each waited for at least 900 s before it counts as hung); "
    "layouts the step does not run are listed with the reason"
)
LIVE_BACKENDS = ("threaded", "gloo", "nccl")


@dataclass(frozen=True)
class StepVerdict:
    """One layout's step: ``result`` when it ran, ``refused`` (the reason) when it did not."""

    result: Any = None  # a RecipeEquivalence
    refused: str | None = None

    @property
    def passed(self) -> bool:
        return self.refused is not None or self.result.passed

    def as_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "ran": r is not None,
            "passed": None if r is None else r.passed,
            "refused": self.refused,
            "step": None if r is None else r.step,
            "backend": None if r is None else r.backend,
            "seconds": None if r is None else round(r.seconds, 4),
            "summary": None if r is None else r.summary,
            "error": None if r is None else r.error,
        }


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--equivalence", action="store_true", help=HELP)


def backend(args: argparse.Namespace) -> str:
    return args.backend if args.backend in LIVE_BACKENDS else "threaded"


def check_args(args: argparse.Namespace) -> None:
    if getattr(args, "equivalence", False) and args.backend == "reference":
        raise UsageError(
            "--equivalence trains each layout on live ranks; --backend reference builds none"
        )


def run(
    args: argparse.Namespace,
    outcomes: Sequence[Any],
    progress: Any,
    stopping: Callable[[], bool],
) -> bool:
    """Each passing outcome's step, into ``outcome.step``; True when all were tried."""
    from meshsim.cli.equivalence import step_timeout
    from meshsim.usage.recipe import check_equivalence, equivalence_refusal

    tier = backend(args)
    todo = []
    for outcome in (o for o in outcomes if o.results and o.passed):
        case = outcome.case
        reason = equivalence_refusal(
            case.framework, case.world_size, tier, real=args.real, **case.config
        )
        if reason is None:
            todo.append(outcome)
        else:  # known without a rank: not counted in the progress or its estimate
            outcome.step = StepVerdict(refused=reason)
    label = f"equivalence ({tier})"
    progress.start(label, len(todo))
    for outcome in todo:
        if stopping():
            progress.finish(label, "stopped")
            return False
        case = outcome.case
        try:
            timeout = step_timeout(args.timeout, args.real, case.framework)
            result = check_equivalence(
                case.framework, case.world_size, tier, real=args.real, timeout=timeout,
                **case.config,
            )  # fmt: skip
            outcome.step = StepVerdict(result=result)
        except UsageError as refusal:
            outcome.step = StepVerdict(refused=str(refusal))
        except RunStopped:  # Ctrl-C or SIGTERM inside the step: no verdict on this layout
            progress.finish(label, "stopped")
            return False
        progress.advance(label, outcome.step.passed)
        if args.fail_fast and not outcome.step.passed:
            progress.finish(label, "stopped")
            return False
    progress.finish(label, "done")
    return True


def print_summary(out: Any, outcomes: Sequence[Any]) -> None:
    """How many steps ran, passed, failed, and each reason a step was not run."""
    verdicts = [o.step for o in outcomes if getattr(o, "step", None) is not None]
    if not verdicts:
        return
    ran = [v for v in verdicts if v.result is not None]
    failed = [v for v in ran if not v.result.passed]
    reasons: dict[str, int] = {}
    for v in verdicts:
        if v.refused is not None:
            reasons[v.refused] = reasons.get(v.refused, 0) + 1
    steps = sorted({v.result.step for v in ran})
    seconds = sum(v.result.seconds for v in ran)
    out.print(
        f"equivalence: {len(ran)} layouts trained, {len(ran) - len(failed)} match their serial "
        f"twin, {len(failed)} do not; {len(verdicts) - len(ran)} not run "
        f"({seconds:.0f} s of steps)",
        markup=False,
    )
    for step in steps:
        out.print(f"  trained: {step}", markup=False)
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        out.print(f"  not run ({count}): {reason}", markup=False)
