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

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from meshsim.cli import render
from meshsim.cli import sweep_equivalence as stepping
from meshsim.cli import sweep_plan as planning
from meshsim.cli import sweep_report as reports
from meshsim.cli.placement import (
    Question,
    crossing_words,
    parse_within,
    print_placement,
    validate_within,
)
from meshsim.cli.sweep_plan import Step
from meshsim.cli.sweep_remote import REFERENCE, Chunk
from meshsim.cli.sweep_report import Outcome, Report
from meshsim.cli.sweep_workers import Workers
from meshsim.errors import UsageError
from meshsim.harness import stopping
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
PARALLEL_TIERS = (REFERENCE, "fake", "threaded")
#: Layouts per chunk of the reference step (no live rank: each takes about a millisecond).
REFERENCE_CHUNK = 64


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
        stopping.request()  # a live check in this process stops its ranks within a tick
        sys.stderr.write(f"meshsim sweep: {name}, stopping now\n")

    def is_set(self) -> bool:
        return self.name is not None


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    """The verb: signals are the sweep's own from here to the end of its reports."""
    stop = _StopRequest()
    stopping.clear()
    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        return _sweep(args, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stopping.clear()


def _sweep(args: argparse.Namespace, stop: _StopRequest) -> int:
    try:
        import meshsim.verify  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UsageError(f"sweep needs meshsim.verify ({exc.name} is missing)") from None
    if args.frameworks:
        args.frameworks = list(dict.fromkeys(args.frameworks))  # --framework F twice: once
    _default_backend(args)
    stepping.check_args(args)
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
    outcomes = [Outcome(case) for case in cases]
    started = time.perf_counter()
    workers = Workers(args.jobs)
    sweep = _Run(args, cases, outcomes, question, workers, stop, started)
    finished = False
    try:
        with _progress(render.console(stderr=True), started) as progress:
            finished = sweep.run(progress)
            if finished and args.equivalence:
                finished = stepping.run(args, outcomes, progress, sweep._stopping)
    finally:
        if finished:
            workers.close(stop.is_set)
        workers.kill()  # a stop, a failure, or one that lingered past close
    elapsed = time.perf_counter() - started
    report = Report(
        args.world_size,
        sweep.tiers,
        [o for o in outcomes if o.results],
        len(cases),
        elapsed,
        stop.name,
        args.real,
        question,
        [o for o in outcomes if o.left_out],
        structures=sweep.structures,
        budget_spent=sweep.budget_spent,
        unbuilt=sweep.unbuilt(),
    )
    _print(out, report)
    if args.json:
        reports.write_json(args.json, report)
    if args.junit_xml:
        reports.write_junit(args.junit_xml, report)
    return report.exit_code


def _default_backend(args: argparse.Namespace) -> None:
    """gloo for --real; else fake up to ``LIVE_DEFAULT_MAX_WORLD`` ranks, the reference
    alone above (said on stderr, with how to run live ones)."""
    if args.backend == REFERENCE:
        live = [f for f, on in _LIVE_FLAGS.items() if getattr(args, on)]
        if live or args.real:
            flag = live[0] if live else "--real"
            raise UsageError(
                f"--backend reference builds no live layout, but {flag} asks for live builds; "
                "use --backend fake (or threaded, gloo) with it"
            )
    if args.backend is not None:
        return
    if args.real:
        args.backend = "gloo"
    elif args.world_size > planning.LIVE_DEFAULT_MAX_WORLD and not args.cross_check:
        from meshsim.model.conventions import validate_world_size

        validate_world_size(args.world_size)  # a refused size: its one line, not ours first
        args.backend = REFERENCE
        print(
            f"meshsim sweep: world {args.world_size} is above "
            f"{planning.LIVE_DEFAULT_MAX_WORLD} ranks: the reference examines every layout "
            "(groups, findings, placement) without live ranks; --backend fake with "
            "--sample N or --budget S also builds live ones",
            file=sys.stderr,
        )
    else:
        args.backend = SWEEP_BACKEND


#: Flags that only mean something for live builds, by the argparse name they set.
_LIVE_FLAGS = {
    "--communicate": "communicate",
    "--exhaustive": "exhaustive",
    "--sample": "sample",
    "--budget": "budget",
    "--cross-check": "cross_check",
}


class _Run:
    """One sweep's steps: the reference on every layout, then the live steps it plans."""

    def __init__(
        self,
        args: argparse.Namespace,
        cases: Sequence[LayoutCase],
        outcomes: list[Outcome],
        question: Question | None,
        workers: Workers,
        stop: _StopRequest,
        started: float,
    ) -> None:
        self.args, self.cases, self.outcomes = args, cases, outcomes
        self.question, self.workers, self.stop = question, workers, stop
        self.started = started
        self.tiers: list[str] = [args.backend] if args.backend == REFERENCE else []
        self.structures: int | None = None
        self.budget_spent = False
        self.deadline: float | None = None
        #: Layouts some live step is to build (those outside are examined by the reference
        #: only: --sample, --backend reference).
        self.planned: set[int] = set()

    def run(self, progress: _Progress) -> bool:
        """True when every step ran to its end (False: a signal, ``--fail-fast`` or
        ``--budget`` stopped it)."""
        every = list(range(len(self.cases)))
        if not self._step(Step(REFERENCE, every), progress, first=True):
            return False
        kept = [i for i in every if not self.outcomes[i].left_out]
        fingerprints = [o.fingerprint for o in self.outcomes]
        representatives, shares = planning.distinct(self.cases, fingerprints, kept)
        self.structures = len(representatives)
        shares = planning.repeats(self.args, shares)
        steps = planning.live_steps(self.args, self.cases, kept, shares)
        self.planned = {i for step in steps for i in step.indices}
        for index in shares.keys() & self.planned:  # --sample plans no repeat
            self.outcomes[index].shares = self.outcomes[shares[index]]
        self.tiers = list(dict.fromkeys(step.tier for step in steps)) or self.tiers
        self._announce(len(kept), steps)
        if self.args.budget is not None:
            self.deadline = time.perf_counter() + self.args.budget
        return all(self._step(step, progress) for step in steps)

    def unbuilt(self) -> list[Outcome]:
        """The layouts the reference examined and no live step built, by design (``--sample``,
        ``--backend reference``) or because ``--budget`` ran out; not those a signal cut off."""
        return [
            o
            for i, o in enumerate(self.outcomes)
            if o.examined
            and not o.results
            and not o.left_out
            and (i not in self.planned or self.budget_spent)
        ]

    def _announce(self, kept: int, steps: Sequence[Step]) -> None:
        """Before the live steps: their size, and a rough estimate of their time."""
        if not steps:
            return
        groups = [o.groups for o in self.outcomes]
        seconds = planning.estimate(steps, self.args.world_size, groups, self.args.jobs)
        plan = "; ".join(f"{step.label} {len(step.indices)}" for step in steps)
        budget = f" (--budget {self.args.budget:g} s)" if self.args.budget is not None else ""
        print(
            f"meshsim sweep: {kept} layouts build {self.structures} distinct group "
            f"structures; live: {plan} layouts; about {_duration(seconds)} estimated{budget}",
            file=sys.stderr,
            flush=True,
        )

    def _step(self, step: Step, progress: _Progress, first: bool = False) -> bool:
        """Run one step, recording each answer in the outcomes; True when it ran to its end."""
        from meshsim.verify import FAKE_BATCH

        if self._stopping():
            return False
        progress.start(step.label, len(step.indices))
        parallel = step.tier in PARALLEL_TIERS
        size = (
            REFERENCE_CHUNK if step.tier == REFERENCE
            else FAKE_BATCH if parallel
            else max(len(step.indices), 1)
        )  # fmt: skip
        parts = [step.indices[i : i + size] for i in range(0, len(step.indices), size)]
        chunks = [
            Chunk(
                [self.cases[i] for i in part],
                step.tier,
                self.args.timeout,
                self.args.real,
                first=first,
                question=self.question,
                ranks=step.ranks,
            )
            for part in parts
        ]
        failed = False
        answers = self.workers.run(chunks, self._stopping, parallel=parallel, tick=progress.tick)
        for chunk, offset, answer in answers:
            outcome = self.outcomes[parts[chunk][offset]]
            if first:
                outcome.examined = True
                outcome.findings, outcome.placed = answer.findings, answer.placed
                outcome.fingerprint, outcome.groups = answer.fingerprint, answer.groups
                if self.args.backend == REFERENCE and answer.result is not None:
                    outcome.results[REFERENCE] = answer.result
            elif answer.result is not None:
                outcome.results[step.tier] = answer.result
            passed = answer.result is None or outcome.passed
            progress.advance(step.label, passed)
            if self.args.fail_fast and not passed:
                failed = True
                break
        stopped = self._stopping() or failed
        note = "stopped (budget spent)" if self.budget_spent else "stopped"
        progress.finish(step.label, note if stopped else "done")
        return not stopped

    def _stopping(self) -> bool:
        if self.stop.is_set():
            return True
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.budget_spent = True
        return self.budget_spent


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
    stepping.print_summary(out, report.outcomes)
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
    """Progress on stderr: a live bar on a terminal, else a plain line at least every
    ``PROGRESS_EVERY`` seconds while a step runs (also while no answer arrives), with the time
    left at the step's rate so far."""

    def __init__(self, console: Any, started: float) -> None:
        self.console = console
        self.started = started
        self.live = console.is_terminal
        self.bar: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.counts: dict[str, list[int]] = {}
        self.step_started: dict[str, float] = {}
        self.current: str | None = None
        self.last = 0.0

    def __enter__(self) -> _Progress:
        if self.live:
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self.bar = Progress(*columns, console=self.console)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def start(self, tier: str, total: int) -> None:
        self.counts[tier] = [0, 0, total]
        self.step_started[tier] = time.monotonic()
        self.current = tier
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
        else:
            self.tick()

    def tick(self) -> None:
        """A line when ``PROGRESS_EVERY`` seconds passed since the last (off a terminal)."""
        due = time.monotonic() - self.last >= PROGRESS_EVERY
        if self.bar is None and self.current is not None and due:
            self._line(self.current, "")

    def finish(self, tier: str, note: str = "done") -> None:
        self.current = None
        if self.bar is None:
            self._line(tier, note)

    def _line(self, tier: str, note: str) -> None:
        done, failed, total = self.counts[tier]
        self.last = time.monotonic()
        left = ""
        if not note and 0 < done < total:
            rate = (self.last - self.step_started[tier]) / done
            left = f", about {_duration(rate * (total - done))} left"
        print(
            f"meshsim sweep: {tier} {done}/{total} layouts, {failed} failed, "
            f"{time.perf_counter() - self.started:.0f} s{left}{' ' + note if note else ''}",
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
