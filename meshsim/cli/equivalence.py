"""``meshsim verify FRAMEWORK ... --equivalence``: the recipe's step against its serial twin."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from meshsim.errors import UsageError
from meshsim.own_steps import STEPS

HELP = (
    "also train the data-flow recipe's tiny model on the N ranks and on one rank, from the "
    "same weights on the same global batch, and compare every gradient and parameter "
    "(threaded/gloo only; the frameworks --dataflow covers); with --real, the framework's "
    f"own training step where meshsim runs it ({', '.join(STEPS)}; it waits at least "
    "900 s before it counts as hung)"
)


#: The least hang guard for a framework's own step: it builds and trains a real model on every
#: rank and on one, minutes at world 8 on two CPU cores; ``--timeout`` (120 s by default, sized
#: for group checks) would fail slow work that is not a hang.
OWN_STEP_TIMEOUT_S = 900.0


def step_timeout(timeout: float, real: bool, framework: str) -> float:
    """The timeout the training step runs under: ``--timeout``, at least
    :data:`OWN_STEP_TIMEOUT_S` where the framework's own step runs."""
    if real and framework in STEPS:
        return max(float(timeout), OWN_STEP_TIMEOUT_S)
    return float(timeout)


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--equivalence", action="store_true", help=HELP)


def check_args(args: argparse.Namespace) -> None:
    """Refuse before any rank runs: as ``--dataflow`` does (the same recipe), or, with
    ``--real`` where the framework's own step runs, only the fake tier."""
    from meshsim.cli import dataflow

    if not (args.real and args.framework in STEPS):
        dataflow.check_args(args, flag="--equivalence")
    elif args.backend == "fake":
        raise UsageError(
            "--equivalence needs real collectives and the fake backend moves no data; use "
            "--backend threaded or --backend gloo"
        )


def run(args: argparse.Namespace, world: int, config: Mapping[str, Any]) -> Any:
    from meshsim.usage.recipe import check_equivalence

    return check_equivalence(
        args.framework,
        world,
        args.backend,
        real=args.real,
        timeout=step_timeout(args.timeout, args.real, args.framework),
        **config,
    )


def as_json(result: Any) -> dict[str, Any]:
    return {
        "passed": result.passed,
        "step": result.step,
        "wiring": result.wiring,
        "seconds": round(result.seconds, 4),
        "error": result.error,
        "summary": result.summary,
    }


def print_result(out: Any, result: Any) -> None:
    verdict = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
    out.print(f"equivalence ({result.seconds:.2f} s): {verdict}")
    out.print(f"trained: {result.step}", markup=False)
    detail = result.summary if result.passed else result.error
    if detail:
        out.print(detail, markup=False)
