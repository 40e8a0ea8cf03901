"""The sweep verb: verify every valid layout, cross-check tiers, report as tables, JSON, JUnit."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshsim.cli import render
from meshsim.cli.commands import result_json
from meshsim.errors import UsageError
from meshsim.model.conventions import CONVENTIONS
from meshsim.model.sweep import LayoutCase, layouts

TIERS = ("fake", "threaded", "gloo")
#: Tiers whose runs live in one process, so several cases can run side by side in workers.
PARALLEL_TIERS = ("fake", "threaded")


@dataclass
class Outcome:
    """One layout's verdict: its result per tier, and whether the tiers agree."""

    case: LayoutCase
    results: dict[str, Any] = field(default_factory=dict)  # tier -> VerifyResult

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results.values()) and self.agree

    @property
    def agree(self) -> bool:
        return len({_signature(r) for r in self.results.values()}) <= 1

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results.values())

    def message(self) -> str:
        lines = []
        if not self.agree:
            lines.append(
                "tiers observed different groups: "
                + "; ".join(
                    f"{tier}: {_signature(r)[1] or 'as expected'}"
                    for tier, r in self.results.items()
                )
            )
        for tier, r in self.results.items():
            if not r.passed:
                lines.append(f"[{tier}] " + (str(r.diff) if r.diff is not None else str(r.error)))
        return "\n".join(lines)


def _signature(result: Any) -> tuple[bool, str]:
    """What a tier observed, comparable across tiers: pass, or the mismatches it found."""
    observations = getattr(result, "observations", None)
    if observations is not None:
        return result.passed, repr(_observed_groups(observations))
    if result.diff is not None:
        return False, "; ".join(sorted(str(m) for m in result.diff.mismatches))
    return result.passed, "" if result.error is None else f"error: {result.error}"


def _observed_groups(observations: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(
        sorted(
            (o.rank, tuple(sorted((n, v.members, v.local_rank) for n, v in o.groups.items())))
            for o in observations
        )
    )


def collect_cases(
    world: int, frameworks: Sequence[str] | None, limit: int | None
) -> list[LayoutCase]:
    names = list(frameworks or CONVENTIONS)
    for name in names:
        from meshsim.cli.config_flags import check_framework

        check_framework(name)
    cases: list[LayoutCase] = []
    for name in names:
        found = layouts(world, name)
        cases += found[:limit] if limit else found
    return cases


def run(args: argparse.Namespace) -> int:
    try:
        import meshsim.verify  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UsageError(f"sweep needs meshsim.verify ({exc.name} is missing)") from None
    cases = collect_cases(args.world_size, args.frameworks, args.limit)
    if not cases:
        raise UsageError(f"no valid layouts for world size {args.world_size}")
    tiers = TIERS if args.cross_check else (args.backend,)
    outcomes = [Outcome(case) for case in cases]
    out = render.console()
    started = time.perf_counter()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=render.console(stderr=True)) as progress:
        for tier in tiers:
            task = progress.add_task(f"{tier:>8}", total=len(cases))
            for index, result in results(cases, tier, args.timeout, args.jobs):
                outcomes[index].results[tier] = result
                progress.advance(task)
                if args.fail_fast and not result.passed:
                    break
            if args.fail_fast and any(not o.passed for o in outcomes if o.results):
                break
    elapsed = time.perf_counter() - started
    done = [o for o in outcomes if o.results]
    summary_table(out, done, tiers, elapsed)
    failures = [o for o in done if not o.passed]
    for o in failures[:10]:
        out.print(f"[red]FAIL[/red] {o.case.id}", markup=True)
        out.print(o.message(), markup=False)
    if len(failures) > 10:
        out.print(f"... {len(failures) - 10} more failures")
    if args.json:
        write_json(args.json, args, done, elapsed)
    if args.junit_xml:
        write_junit(args.junit_xml, done, tiers, elapsed)
    return 1 if failures else 0


def results(
    cases: Sequence[LayoutCase], tier: str, timeout: float, jobs: int = 1
) -> Iterator[tuple[int, Any]]:
    """(case index, VerifyResult) as they arrive; fake/threaded chunks spread over ``jobs``
    processes (each case is independent, and the fake tier is CPU-bound in one process)."""
    from meshsim.verify import FAKE_BATCH, verify_many

    if jobs <= 1 or tier not in PARALLEL_TIERS or len(cases) <= FAKE_BATCH:
        yield from enumerate(verify_many(cases, tier, timeout=timeout))
        return
    chunks = [(i, list(cases[i : i + FAKE_BATCH])) for i in range(0, len(cases), FAKE_BATCH)]
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch state
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context)
    try:
        futures = {pool.submit(verify_chunk, chunk, tier, timeout): i for i, chunk in chunks}
        for future in as_completed(futures):
            for offset, result in enumerate(future.result()):
                yield futures[future] + offset, result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def verify_chunk(cases: list[LayoutCase], tier: str, timeout: float) -> list[Any]:
    """Run in a sweep worker process: verify a chunk of cases on one tier."""
    from meshsim.verify import verify_many

    return list(verify_many(cases, tier, timeout=timeout))


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def summary_table(out: Any, outcomes: list[Outcome], tiers: Sequence[str], elapsed: float) -> None:
    table = Table(title=f"sweep on {', '.join(tiers)} ({elapsed:.1f} s)", header_style="bold")
    for title in ("framework", "layouts", "passed", "failed", "tiers disagree", "seconds"):
        table.add_column(title, justify="left" if title == "framework" else "right")
    by_framework: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_framework.setdefault(o.case.framework, []).append(o)
    for name, group in [*by_framework.items(), ("total", outcomes)]:
        failed = sum(not o.passed for o in group)
        table.add_row(
            f"[bold]{name}[/bold]" if name == "total" else name,
            str(len(group)),
            str(len(group) - failed),
            f"[red]{failed}[/red]" if failed else "0",
            str(sum(not o.agree for o in group)) if len(tiers) > 1 else "–",
            f"{sum(o.seconds for o in group):.1f}",
        )
    out.print(table)


def write_json(
    path: str, args: argparse.Namespace, outcomes: list[Outcome], elapsed: float
) -> None:
    data = {
        "world_size": args.world_size,
        "tiers": list(next(iter(outcomes)).results) if outcomes else [],
        "seconds": elapsed,
        "passed": sum(o.passed for o in outcomes),
        "failed": sum(not o.passed for o in outcomes),
        "results": [
            {
                "id": o.case.id,
                "framework": o.case.framework,
                "config": o.case.config,
                "passed": o.passed,
                "agree": o.agree,
                "tiers": {tier: result_json(r) for tier, r in o.results.items()},
            }
            for o in outcomes
        ],
    }
    with open(path, "w", encoding="utf-8") as stream:
        render.print_json(data, stream)


def write_junit(path: str, outcomes: list[Outcome], tiers: Sequence[str], elapsed: float) -> None:
    """One testcase per layout (classname meshsim.sweep.<framework>), a failure per mismatch."""
    failed = sum(not o.passed for o in outcomes)
    suites = ET.Element(
        "testsuites", tests=str(len(outcomes)), failures=str(failed), time=f"{elapsed:.3f}"
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"meshsim sweep ({', '.join(tiers)})",
        tests=str(len(outcomes)),
        failures=str(failed),
        errors="0",
        skipped="0",
        time=f"{elapsed:.3f}",
    )
    for o in outcomes:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"meshsim.sweep.{o.case.framework}",
            name=o.case.id,
            time=f"{o.seconds:.3f}",
        )
        if not o.passed:
            text = o.message()
            failure = ET.SubElement(case, "failure", message=text.splitlines()[0] if text else "")
            failure.text = text
    ET.ElementTree(suites).write(Path(path), encoding="utf-8", xml_declaration=True)
