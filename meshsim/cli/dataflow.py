"""``meshsim verify FRAMEWORK ... --dataflow``: the data-flow recipe after the group check."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from meshsim.errors import UsageError

HELP = (
    "also train a tiny model the framework's way and prove the data loader splits over the "
    "data mesh and the wrapper reduces over the gradient mesh (threaded/gloo only; "
    "olmo-core, torchtitan, accelerate, transformers, lightning and verl)"
)


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataflow", action="store_true", help=HELP)


def check_args(args: argparse.Namespace, flag: str = "--dataflow") -> None:
    """Refuse before any rank runs: the fake tier moves no data, other conventions lack a recipe.
    Shared by every flag that trains the recipe (``--dataflow``, ``--equivalence``)."""
    from meshsim.dataflow.meshes import FRAMEWORKS

    if args.backend == "fake":
        raise UsageError(
            f"{flag} needs real collectives and the fake backend moves no data; use "
            "--backend threaded or --backend gloo"
        )
    if args.framework not in FRAMEWORKS:
        raise UsageError(f"{flag} has a recipe for {', '.join(FRAMEWORKS)}, not {args.framework!r}")


def run(args: argparse.Namespace, world: int, config: Mapping[str, Any]) -> Any:
    from meshsim.dataflow.recipes import check_dataflow

    return check_dataflow(
        args.framework, world, args.backend, real=args.real, timeout=args.timeout, **config
    )


def as_json(result: Any) -> dict[str, Any]:
    return {
        "passed": result.passed,
        "wiring": result.wiring,
        "seconds": round(result.seconds, 4),
        "error": result.error,
        "data_error": result.data_error,
        "gradient_error": result.gradient_error,
        "not_compared": list(result.not_compared),
    }


def print_result(out: Any, result: Any) -> None:
    verdict = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
    if result.passed and result.not_compared:
        verdict = "[yellow]PASS only where compared[/yellow]"
    out.print(f"dataflow ({result.seconds:.2f} s): {verdict}")
    if not result.passed or result.not_compared:
        out.print(str(result).split("\n", 1)[1], markup=False)
