"""The sweep verb: verify every valid layout, cross-check tiers, answer where groups sit on
nodes; report as tables, JSON, JUnit, also when a signal stops it.

Layouts are verified in worker processes (``meshsim.cli.sweep_workers``); this process only
plans, waits for their answers and writes the reports. So the first Ctrl-C or SIGTERM stops
the sweep at once: the workers are killed with every process they started, and the reports
hold every layout whose answer had arrived (exit 130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshsim.cli import render
from meshsim.cli import sweep_report as reports
from meshsim.cli.placement import (
    Question,
    crossing_words,
    parse_within,
    print_placement,
    validate_within,
)
from meshsim.cli.sweep_remote import Chunk
from meshsim.cli.sweep_report import Outcome, Report
from meshsim.cli.sweep_workers import Workers
from meshsim.errors import UsageError
from meshsim.model.conventions import CONVENTIONS
from meshsim.model.sweep import LayoutCase, layouts

TIERS = ("fake", "threaded", "gloo")
#: The default tier: fake checks every group of every layout without communicating, and costs
#: several times less than gloo per layout (benchmarks/ section 4), so real communication runs
#: on a sample (``--communicate N``) or, with ``--backend gloo``, on everything. ``--real``
#: defaults to gloo: the frameworks' own code expects a communicating world.
SWEEP_BACKEND = "fake"
#: Seconds between progress lines when stderr is not a terminal (a log file, CI).
PROGRESS_EVERY = 5.0
#: Tiers whose runs live in one process, so several cases can run side by side in workers.
PARALLEL_TIERS = ("fake", "threaded")


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


def plan(
    args: argparse.Namespace, cases: Sequence[LayoutCase], kept: Sequence[int] | None = None
) -> list[tuple[str, list[int]]]:
    """(tier, case indices) in run order: the chosen tier on every case, then the samples.

    ``kept``: the cases the first step kept (``--within-node`` leaves out the others, and the
    later steps run on, and sample from, the kept ones only); default every case.
    """
    every = list(range(len(cases)))
    kept = every if kept is None else list(kept)
    if args.cross_check:
        return [(TIERS[0], every)] + [(tier, kept) for tier in TIERS[1:]]
    steps = [(args.backend, every)]
    if args.communicate:
        chosen = [kept[i] for i in sample([cases[i] for i in kept], args.communicate)]
        steps += [(tier, chosen) for tier in ("threaded", "gloo") if tier != args.backend]
    return steps


class _StopRequest:
    """The handler of SIGINT and SIGTERM during a sweep: it records the first signal, and the
    sweep, which only waits for its workers' answers, sees it within ``POLL_S`` and stops.

    Raising from the handler instead would land at whatever bytecode runs next, possibly
    inside code that cannot take an exception, and a KeyboardInterrupt that escapes makes
    CPython exit by SIGINT whatever ``main`` returned. A second signal changes nothing: the
    workers are killed at once and only the reports are left to write, which takes a moment.
    """

    def __init__(self) -> None:
        self.name: str | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.name is not None:
            sys.stderr.write(f"meshsim sweep: {name}, already stopping\n")
            return
        self.name = name
        sys.stderr.write(f"meshsim sweep: {name}, stopping now\n")

    def is_set(self) -> bool:
        return self.name is not None


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    """The verb: signals are the sweep's own from here to the end of its reports."""
    stop = _StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        return _sweep(args, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _sweep(args: argparse.Namespace, stop: _StopRequest) -> int:
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
    question = _question(args, cases)
    _say_what_varies(cases, args.world_size, render.console(stderr=True))
    tiers = [tier for tier, _ in plan(args, cases)]
    outcomes = [Outcome(case) for case in cases]
    started = time.perf_counter()
    workers = Workers(args.jobs)
    finished = False
    try:
        with _progress(render.console(stderr=True), started) as progress:
            finished = _steps(args, cases, outcomes, question, workers, progress, stop)
    finally:
        if finished:
            workers.close(stop.is_set)
        workers.kill()  # a stop, a failure, or one that lingered past close
    elapsed = time.perf_counter() - started
    report = Report(
        args.world_size,
        tiers,
        [o for o in outcomes if o.results],
        len(cases),
        elapsed,
        stop.name,
        args.real,
        question,
        [o for o in outcomes if o.left_out],
    )
    _print(out, report)
    if args.json:
        reports.write_json(args.json, report)
    if args.junit_xml:
        reports.write_junit(args.junit_xml, report)
    return report.exit_code


def _steps(
    args: argparse.Namespace,
    cases: Sequence[LayoutCase],
    outcomes: list[Outcome],
    question: Question | None,
    workers: Workers,
    progress: _Progress,
    stop: _StopRequest,
) -> bool:
    """Run the plan's steps, recording each answer in ``outcomes``; True when every step ran
    to its end (False: stopped by a signal or ``--fail-fast``)."""
    from meshsim.verify import FAKE_BATCH

    steps = plan(args, cases)
    for number in range(len(steps)):
        if number:  # the later steps run on what the first kept
            kept = [i for i, o in enumerate(outcomes) if o.results]
            steps = plan(args, cases, kept)
        tier, indices = steps[number]
        if stop.is_set():
            return False
        progress.start(tier, len(indices))
        parallel = tier in PARALLEL_TIERS
        size = FAKE_BATCH if parallel else max(len(indices), 1)
        parts = [indices[i : i + size] for i in range(0, len(indices), size)]
        chunks = [
            Chunk(
                [cases[i] for i in part],
                tier,
                args.timeout,
                args.real,
                first=number == 0,
                question=question,
            )
            for part in parts
        ]
        failed = False
        for chunk, offset, answer in workers.run(chunks, stop.is_set, parallel=parallel):
            outcome = outcomes[parts[chunk][offset]]
            if number == 0:
                outcome.findings, outcome.placed = answer.findings, answer.placed
            if answer.result is not None:
                outcome.results[tier] = answer.result
            passed = answer.result is None or outcome.passed
            progress.advance(tier, passed)
            if args.fail_fast and not passed:
                failed = True
                break
        progress.finish(tier, "stopped" if stop.is_set() or failed else "done")
        if stop.is_set() or failed:
            return False
    return True


def _question(args: argparse.Namespace, cases: Sequence[LayoutCase]) -> Question | None:
    """What ``--gpus-per-node`` / ``--within-node`` ask, names checked; None when not asked."""
    within = parse_within(args.within_node)
    if args.gpus_per_node is None:
        if within:
            raise UsageError(
                "--within-node needs --gpus-per-node G: a node is G consecutive ranks "
                "(node = rank // G)"
            )
        return None
    validate_within(within, cases)
    return Question(args.gpus_per_node, within)


def _print(out: Any, report: Report) -> None:
    """The console's report: the table, findings, node placement, the first failures."""
    reports.summary_table(out, report)
    reports.print_findings(out, report)
    print_placement(out, report)
    failures = [o for o in report.outcomes if not o.passed]
    for o in failures[:10]:
        where = f" (crossing nodes: {crossing_words(o.placed)})" if o.placed else ""
        out.print(f"[red]FAIL[/red] {o.case.id}{where}", markup=True)
        out.print(o.message(), markup=False)
    if len(failures) > 10:
        out.print(f"... {len(failures) - 10} more failures")
    if report.interrupted:
        out.print(
            f"[yellow]interrupted by {report.interrupted}[/yellow] after {report.done} of "
            f"{report.total} layouts; the reports hold what finished"
        )


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

    def __enter__(self) -> _Progress:
        if self.live:
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

    def finish(self, tier: str, note: str = "done") -> None:
        if self.bar is None:
            self._line(tier, note)

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


def _say_what_varies(cases: Sequence[LayoutCase], world_size: int, out: Any) -> None:
    """One line per framework on stderr: the options this sweep varies, and over what."""
    from meshsim.model.sweep import describe_options, varied_options

    by_framework: dict[str, list[LayoutCase]] = {}
    for case in cases:
        by_framework.setdefault(case.framework, []).append(case)
    for framework, listed in by_framework.items():
        varied = varied_options(framework, world_size, cases=listed)
        if varied:
            shown = "; ".join(describe_options(varied, most=4, width=28))
            out.print(f"{framework} ({len(listed)} layouts) varies {shown}", markup=False)


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
