"""The sweep verb: verify every valid layout, cross-check tiers, report as tables, JSON, JUnit."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshsim.cli import outputs, render
from meshsim.cli.captured import captured, tail
from meshsim.cli.commands import findings_json, result_json
from meshsim.errors import LayoutError, UsageError
from meshsim.model.conventions import CONVENTIONS
from meshsim.model.sweep import LayoutCase, layouts

TIERS = ("fake", "threaded", "gloo")
#: The default tier: fake checks every group of every layout without communicating, and costs
#: several times less than gloo per layout (benchmarks/ section 4), so real communication runs
#: on a sample (``--communicate N``) or, with ``--backend gloo``, on everything. ``--real``
#: defaults to gloo: the frameworks' own code expects a communicating world.
SWEEP_BACKEND = "fake"
#: Tiers that move data: each group is proven by an all-gather over it.
COMMUNICATING = ("threaded", "gloo", "nccl")
#: Seconds between progress lines when stderr is not a terminal (a log file, CI).
PROGRESS_EVERY = 5.0
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
                printed = getattr(r, "output", "")
                if printed.strip():
                    lines.append(f"[{tier}] what the framework printed while building it:")
                    lines.append(tail(printed))
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


def sample(cases: Sequence[LayoutCase], per_framework: int) -> list[int]:
    """Indices of ``per_framework`` evenly spaced cases of each framework (first and last kept)."""
    by_framework: dict[str, list[int]] = {}
    for index, case in enumerate(cases):
        by_framework.setdefault(case.framework, []).append(index)
    chosen: list[int] = []
    for indices in by_framework.values():
        k = min(per_framework, len(indices))
        if k == 1:
            chosen.append(indices[0])
        elif k > 1:
            chosen += sorted({indices[round(i * (len(indices) - 1) / (k - 1))] for i in range(k)})
    return chosen


def plan(args: argparse.Namespace, cases: Sequence[LayoutCase]) -> list[tuple[str, list[int]]]:
    """(tier, case indices) in run order: the chosen tier on every case, then the samples."""
    if args.cross_check:
        return [(tier, list(range(len(cases)))) for tier in TIERS]
    steps = [(args.backend, list(range(len(cases))))]
    if args.communicate:
        chosen = sample(cases, args.communicate)
        steps += [(tier, chosen) for tier in ("threaded", "gloo") if tier != args.backend]
    return steps


class _Interrupted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: stop now, wherever the sweep is."""


class _StopRequest:
    """The signal handler for SIGINT and SIGTERM during a sweep.

    The first signal only records itself, and the sweep stops after the result in hand. An
    exception raised from a handler lands at whatever bytecode runs next: inside torch's
    pybind11 import code it aborts the process (``terminate called after throwing``), and a
    bare KeyboardInterrupt escaping code run from a source string makes CPython exit by SIGINT
    whatever ``main`` returned, so either way the partial reports and the exit code were lost
    now and then. A second signal still raises at once, for a sweep stuck in one layout.
    """

    def __init__(self) -> None:
        self.name: str | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.name is not None:
            raise _Interrupted(name)
        self.name = name
        sys.stderr.write(f"meshsim sweep: {name}, stopping after the current layouts\n")


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    try:
        import meshsim.verify  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UsageError(f"sweep needs meshsim.verify ({exc.name} is missing)") from None
    if args.backend is None:
        args.backend = "gloo" if args.real else SWEEP_BACKEND
    if args.frameworks:
        args.frameworks = list(dict.fromkeys(args.frameworks))  # --framework F twice: once
    out = render.console(stderr=args.json == "-")
    if args.real:
        args.frameworks = real_frameworks(args.frameworks, out)
    cases = collect_cases(args.world_size, args.frameworks, args.limit)
    if args.real:
        cases = real_cases(cases, out)
    if not cases:
        raise UsageError(f"no valid layouts for world size {args.world_size}")
    steps = plan(args, cases)
    tiers = [tier for tier, _ in steps]
    outcomes = [Outcome(case) for case in cases]
    started = time.perf_counter()
    interrupted: str | None = None
    stop = _StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        with _progress(render.console(stderr=True), started) as progress:
            for tier, indices in steps:
                progress.start(tier, len(indices))
                chosen = [cases[i] for i in indices]
                found = results(chosen, tier, args.timeout, args.jobs, real=args.real)
                for index, result in found:
                    outcomes[indices[index]].results[tier] = result
                    progress.advance(tier, result.passed)
                    if stop.name or (args.fail_fast and not result.passed):
                        break
                progress.finish(tier)
                failed = any(not o.passed for o in outcomes if o.results)
                if stop.name or (args.fail_fast and failed):
                    break
        interrupted = stop.name
    except KeyboardInterrupt as exc:  # a second signal, or a SIGINT before the handler was set
        interrupted = str(exc) if isinstance(exc, _Interrupted) else "SIGINT"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    elapsed = time.perf_counter() - started
    done = [o for o in outcomes if o.results]
    report = Report(args.world_size, tiers, done, len(cases), elapsed, interrupted, args.real)
    summary_table(out, report)
    print_findings(out, report)
    failures = [o for o in done if not o.passed]
    for o in failures[:10]:
        out.print(f"[red]FAIL[/red] {o.case.id}", markup=True)
        out.print(o.message(), markup=False)
    if len(failures) > 10:
        out.print(f"... {len(failures) - 10} more failures")
    if interrupted:
        out.print(
            f"[yellow]interrupted by {interrupted}[/yellow] after {len(done)} of "
            f"{len(cases)} layouts; the reports hold what finished"
        )
    if args.json:
        write_json(args.json, report)
    if args.junit_xml:
        write_junit(args.junit_xml, report)
    if interrupted:
        return 130 if interrupted == "SIGINT" else 143
    return 1 if failures else 0


@dataclass
class Report:
    """What a sweep did, finished or not: the input of the table, JSON and JUnit writers."""

    world_size: int
    tiers: list[str]
    outcomes: list[Outcome]
    total: int  # layouts the sweep was asked to verify
    elapsed: float  # wall seconds of the whole sweep, pool starts included
    interrupted: str | None = None  # the signal that stopped it, None when it ran to the end
    real: bool = False  # built by the frameworks' own code (--real), not meshsim's builders


class _Progress:
    """Progress on stderr: a live bar on a terminal, else a plain line every few seconds."""

    def __init__(self, console: Any, started: float) -> None:
        self.console = console
        self.started = started
        self.live = console.is_terminal
        self.bar: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.counts: dict[str, list[int]] = {}
        self.last = 0.0
        self.own_file: Any = None

    def __enter__(self) -> _Progress:
        if self.live:
            # The bar redraws from its own thread, also while a step's output is captured
            # (descriptors 1 and 2 redirected, see meshsim.cli.captured): it draws on its own
            # copy of the terminal's descriptor, so it neither vanishes nor lands in a report.
            self.console.file = os.fdopen(os.dup(self.console.file.fileno()), "w", buffering=1)
            self.own_file = self.console.file
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            self.bar = Progress(*columns, console=self.console)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
        if self.own_file is not None:
            self.own_file.close()

    def start(self, tier: str, total: int) -> None:
        self.counts[tier] = [0, 0, total]
        if self.bar is not None:
            self.tasks[tier] = self.bar.add_task(f"{tier:>8}", total=total)
        else:
            self._line(tier, "started")

    def advance(self, tier: str, passed: bool) -> None:
        count = self.counts[tier]
        count[0] += 1
        count[1] += not passed
        if self.bar is not None:
            self.bar.advance(self.tasks[tier])
        elif time.monotonic() - self.last >= PROGRESS_EVERY:
            self._line(tier, "")

    def finish(self, tier: str) -> None:
        if self.bar is None:
            self._line(tier, "done")

    def _line(self, tier: str, note: str) -> None:
        done, failed, total = self.counts[tier]
        self.last = time.monotonic()
        print(
            f"meshsim sweep: {tier} {done}/{total} layouts, {failed} failed, "
            f"{time.perf_counter() - self.started:.0f} s{' ' + note if note else ''}",
            file=sys.stderr,
            flush=True,
        )


def _progress(console: Any, started: float) -> _Progress:
    return _Progress(console, started)


def results(
    cases: Sequence[LayoutCase], tier: str, timeout: float, jobs: int = 1, *, real: bool = False
) -> Iterator[tuple[int, Any]]:
    """(case index, VerifyResult) as they arrive; fake/threaded chunks spread over ``jobs``
    processes (each case is independent, and the fake tier is CPU-bound in one process)."""
    from meshsim.verify import FAKE_BATCH, verify_many

    if jobs <= 1 or tier not in PARALLEL_TIERS or len(cases) <= FAKE_BATCH:
        found = verify_many(cases, tier, timeout=timeout, real=real)
        yield from enumerate(captured(found, _batch(tier)))
        return
    chunks = [(i, list(cases[i : i + FAKE_BATCH])) for i in range(0, len(cases), FAKE_BATCH)]
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch state
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context)
    try:
        futures = {pool.submit(verify_chunk, chunk, tier, timeout, real): i for i, chunk in chunks}
        for future in as_completed(futures):
            for offset, result in enumerate(future.result()):
                yield futures[future] + offset, result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def verify_chunk(
    cases: list[LayoutCase], tier: str, timeout: float, real: bool = False
) -> list[Any]:
    """Run in a sweep worker process: verify a chunk of cases on one tier."""
    from meshsim.verify import verify_many

    return list(captured(verify_many(cases, tier, timeout=timeout, real=real), _batch(tier)))


def _batch(tier: str) -> int:
    """How many consecutive cases one run builds on ``tier`` (``verify_many``'s fake batches;
    a sweep has one world size, so they are aligned blocks), 0 when each case runs alone."""
    from meshsim.verify import FAKE_BATCH

    return FAKE_BATCH if tier == "fake" else 0


def real_cases(cases: Sequence[LayoutCase], out: Any) -> list[LayoutCase]:
    """The layouts the installed frameworks' own code can build; the others (lines of a
    framework only the reference models) are counted on the console with the reason."""
    from meshsim.builders.real import outside_adapter

    kept: list[LayoutCase] = []
    left: dict[tuple[str, str], int] = {}
    for case in cases:
        why = outside_adapter(case.framework, case.config)
        if why is None:
            kept.append(case)
        else:
            left[(case.framework, why)] = left.get((case.framework, why), 0) + 1
    for (framework, why), count in left.items():
        out.print(f"[yellow]sweep --real leaves out {count} {framework} layouts[/yellow]: ", end="")
        out.print(why, markup=False)
    return kept


def real_frameworks(asked: Sequence[str] | None, out: Any) -> list[str]:
    """The frameworks ``sweep --real`` runs: those asked for (each must be runnable here: a
    usage error says why not), else every one with an adapter that is installed; the others
    are named on the console with the reason."""
    from meshsim.builders import real as adapters

    if asked:
        for name in asked:
            reason = adapters.unavailable(name)
            if reason is not None:
                raise UsageError(f"sweep {reason}")
        return list(asked)
    runnable = [n for n in adapters.REAL_BUILDERS if adapters.unavailable(n) is None]
    for name in adapters.REAL_BUILDERS:
        if name not in runnable:
            out.print(f"[yellow]sweep --real leaves out {name}[/yellow]: ", end="")
            out.print(adapters.unavailable(name), markup=False)
    if not runnable:
        raise UsageError(
            "sweep --real found no framework installed to run; " + adapters.install_hint("megatron")
        )
    return runnable


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def proven_groups(result: Any) -> int:
    """Distinct groups an all-gather over the group confirmed (0 on fake, which cannot)."""
    seen = set()
    for observation in getattr(result, "observations", None) or ():
        for name, view in observation.groups.items():
            if view.gathered is not None and view.gathered == view.members:
                seen.add((name, view.members))
    return len(seen)


def tier_rows(report: Report) -> list[dict[str, Any]]:
    """One row per (convention, tier): layouts verified, passed, failed, groups proven."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for o in report.outcomes:
        for tier, result in o.results.items():
            row = rows.setdefault(
                (o.case.framework, tier),
                {
                    "framework": o.case.framework,
                    "tier": tier,
                    "layouts": 0,
                    "passed": 0,
                    "failed": 0,
                    "groups_proven": 0,
                    "build_seconds": 0.0,
                },
            )
            row["layouts"] += 1
            row["passed" if result.passed else "failed"] += 1
            row["groups_proven"] += proven_groups(result)
            row["build_seconds"] += result.seconds
    order = {t: i for i, t in enumerate(report.tiers)}
    return sorted(rows.values(), key=lambda r: (r["framework"], order.get(r["tier"], 99)))


def summary_table(out: Any, report: Report) -> None:
    """Convention x tier: what was verified where, and what was proven by communication."""
    state = f", interrupted by {report.interrupted}" if report.interrupted else ""
    table = Table(
        title=f"sweep of world {report.world_size} on {', '.join(report.tiers)}"
        f"{' (real frameworks)' if report.real else ''}: "
        f"{len(report.outcomes)} of {report.total} layouts in {report.elapsed:.1f} s wall{state}",
        header_style="bold",
    )
    titles = (
        "framework",
        "tier",
        "layouts",
        "passed",
        "failed",
        "groups proven by all-gather",
        "build+check s (sum)",
    )
    for title in titles:
        table.add_column(title, justify="left" if title in ("framework", "tier") else "right")
    rows = tier_rows(report)
    previous = None
    for row in rows:
        proven = row["groups_proven"] if row["tier"] in COMMUNICATING else "– (no comm.)"
        table.add_row(
            row["framework"] if row["framework"] != previous else "",
            row["tier"],
            str(row["layouts"]),
            str(row["passed"]),
            f"[red]{row['failed']}[/red]" if row["failed"] else "0",
            str(proven),
            f"{row['build_seconds']:.1f}",
        )
        previous = row["framework"]
    failed = sum(not o.passed for o in report.outcomes)
    disagree = sum(not o.agree for o in report.outcomes)
    table.add_section()
    table.add_row(
        "[bold]total[/bold]",
        "",
        str(len(report.outcomes)),
        str(len(report.outcomes) - failed),
        f"[red]{failed}[/red]" if failed else "0",
        str(sum(r["groups_proven"] for r in rows)),
        f"{sum(r['build_seconds'] for r in rows):.1f}",
    )
    out.print(table)
    compared = sum(len(o.results) > 1 for o in report.outcomes)
    out.print(
        "[dim]fake builds every group and compares it with the reference, without "
        "communicating; threaded and gloo also prove each group by an all-gather over it. "
        "build+check s: summed per-layout time of the slowest rank's build plus the diff "
        "(excludes process and pool start; the wall time above includes them).[/dim]"
    )
    if compared:
        out.print(
            f"tiers compared on {compared} layouts: "
            + ("[green]all agree[/green]" if not disagree else f"[red]{disagree} disagree[/red]")
        )


def layout_findings(case: LayoutCase) -> list[dict[str, str]]:
    """The invariants the reference layout of ``case`` breaks (``show`` and ``verify`` print
    them too): what the framework's own rules build there is wrong, however well it matched.
    A layout the reference refuses (another torch release's) has none."""
    try:
        expected = case.expect()
    except LayoutError:
        return []
    return findings_json(expected)


def print_findings(out: Any, report: Report) -> None:
    """One line per convention whose layouts break an invariant, by check; nothing when none."""
    counts: dict[str, Counter[str]] = {}
    layouts = 0
    for o in report.outcomes:
        found = layout_findings(o.case)
        layouts += bool(found)
        for finding in found:
            counts.setdefault(o.case.framework, Counter())[finding["check"]] += 1
    if not counts:
        return
    out.print(
        f"[yellow]findings[/yellow]: {layouts} of {len(report.outcomes)} layouts are what their "
        "framework's own rules build, and break an invariant (`meshsim show F ...` names each; "
        "`verify --strict` fails on them):"
    )
    for framework, checks in counts.items():
        text = ", ".join(f"{check}: {n}" for check, n in checks.items())
        out.print(f"  {framework}: {text}", markup=False)


def report_json(report: Report) -> dict[str, Any]:
    """The sweep's JSON document (``--json``): the same shape finished or interrupted."""
    return {
        "verb": "sweep",
        "schema_version": render.JSON_SCHEMA_VERSION,
        "world_size": report.world_size,
        "tiers": report.tiers,
        "real": report.real,
        "seconds": report.elapsed,
        "complete": report.interrupted is None and len(report.outcomes) == report.total,
        "interrupted": report.interrupted,
        "layouts_total": report.total,
        "layouts_done": len(report.outcomes),
        "passed": sum(o.passed for o in report.outcomes),
        "failed": sum(not o.passed for o in report.outcomes),
        "exit_code": (
            (130 if report.interrupted == "SIGINT" else 143)
            if report.interrupted
            else int(any(not o.passed for o in report.outcomes))
        ),
        "summary": tier_rows(report),
        "results": [
            {
                "id": o.case.id,
                "framework": o.case.framework,
                "config": o.case.config,
                "passed": o.passed,
                "agree": o.agree,
                "findings": layout_findings(o.case),
                "tiers": {tier: result_json(r) for tier, r in o.results.items()},
            }
            for o in report.outcomes
        ],
    }


def write_json(path: str, report: Report) -> None:
    """``-`` prints to stdout; else the file is written whole, then renamed into place."""
    data = report_json(report)
    if path == "-":
        render.print_json(data)
        return
    outputs.write(path, lambda stream: render.print_json(data, stream))


def write_junit(path: str, report: Report) -> None:
    """One testcase per layout (classname meshsim.sweep.<framework>), a failure per mismatch;
    an interrupted sweep adds an ``interrupted`` property and one error naming the signal."""
    outcomes = report.outcomes
    failed = sum(not o.passed for o in outcomes)
    errors = 1 if report.interrupted else 0
    suites = ET.Element(
        "testsuites",
        tests=str(len(outcomes) + errors),
        failures=str(failed),
        errors=str(errors),
        time=f"{report.elapsed:.3f}",
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"meshsim sweep ({', '.join(report.tiers)})",
        tests=str(len(outcomes) + errors),
        failures=str(failed),
        errors=str(errors),
        skipped="0",
        time=f"{report.elapsed:.3f}",
    )
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("world_size", report.world_size),
        ("layouts_total", report.total),
        ("layouts_done", len(outcomes)),
        ("interrupted", report.interrupted or ""),
    ):
        ET.SubElement(properties, "property", name=name, value=str(value))
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
    if report.interrupted:
        case = ET.SubElement(suite, "testcase", classname="meshsim.sweep", name="interrupted")
        ET.SubElement(
            case,
            "error",
            message=f"sweep interrupted by {report.interrupted} after {len(outcomes)} of "
            f"{report.total} layouts",
        )
    tree = ET.ElementTree(suites)
    outputs.write(
        path, lambda stream: tree.write(stream, encoding="utf-8", xml_declaration=True), binary=True
    )
