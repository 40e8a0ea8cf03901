"""What a sweep did, as its reports: the summary table and findings on the console, the
``--json`` document and the JUnit XML, written the same way finished or interrupted (node
placement: ``meshsim.cli.placement``)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from meshsim.cli import outputs, render
from meshsim.cli.captured import tail
from meshsim.cli.commands import findings_json, result_json
from meshsim.cli.placement import Placed, Question, placement_json, placement_properties
from meshsim.errors import LayoutError
from meshsim.model.sweep import LayoutCase

#: Tiers that move data: each group is proven by an all-gather over it.
COMMUNICATING = ("threaded", "gloo", "nccl")


@dataclass
class Outcome:
    """One layout's verdict: its result per tier, and whether the tiers agree."""

    case: LayoutCase
    results: dict[str, Any] = field(default_factory=dict)  # tier -> VerifyResult
    #: The invariants the reference layout breaks (``show`` and ``verify`` print them too),
    #: answered by the worker with the first result; None until then.
    findings: list[dict[str, str]] | None = None
    #: Where its groups sit on nodes (``--gpus-per-node``); None when not asked.
    placed: Placed | None = None
    #: The reference step answered for it (findings, placement, fingerprint are known).
    examined: bool = False
    #: Its groups' digest, kind names aside (``meshsim.model.fingerprint``); None until the
    #: reference step answers, or when the reference refuses the layout.
    fingerprint: str | None = None
    #: Process groups its framework creates (the size of a live build).
    groups: int = 0
    #: The layout that builds the same groups and proves them live, where this one is built on
    #: a few fake ranks only (``meshsim.cli.sweep_plan``); None when it is proven itself.
    shares: Outcome | None = None
    #: ``--equivalence``: its training step against the serial twin (a ``StepVerdict``); None
    #: when not asked, or when its groups failed.
    step: Any = None

    @property
    def left_out(self) -> bool:
        """``--within-node`` left it out: a named kind crosses nodes, so it was not built."""
        return self.placed is not None and not self.placed.kept

    @property
    def passed(self) -> bool:
        groups = all(r.passed for r in self.results.values()) and self.agree
        return groups and (self.step is None or self.step.passed)

    @property
    def agree(self) -> bool:
        """Every tier that built it observed the same groups (on every rank it built)."""
        built = [r for r in self.results.values() if r.backend != "reference"]
        return len({_signature(r) for r in built}) <= 1

    @property
    def seconds(self) -> float:
        stepped = self.step.result.seconds if self.step is not None and self.step.result else 0
        return float(sum(r.seconds for r in self.results.values()) + stepped)

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
        if self.step is not None and not self.step.passed:
            lines.append(f"[equivalence] {self.step.result.error}")
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


@dataclass
class Report:
    """What a sweep did, finished or not: the input of the table, JSON and JUnit writers."""

    world_size: int
    tiers: list[str]
    outcomes: list[Outcome]  # the layouts verified, on one tier at least
    total: int  # layouts the sweep was asked to examine
    elapsed: float  # wall seconds of the whole sweep, worker starts included
    interrupted: str | None = None  # the signal that stopped it, None when it ran to the end
    real: bool = False  # built by the frameworks' own code (--real), not meshsim's builders
    question: Question | None = None  # --gpus-per-node / --within-node
    left_out: list[Outcome] = field(default_factory=list)  # by --within-node, not built
    #: Distinct group structures among the layouts the reference examined (None: the
    #: reference step did not finish).
    structures: int | None = None
    #: ``--budget`` ran out before every live step had run.
    budget_spent: bool = False
    #: Layouts the reference examined but no live step built (``--sample``, ``--budget``).
    unbuilt: list[Outcome] = field(default_factory=list)

    @property
    def done(self) -> int:
        """Layouts examined: verified, or left out by ``--within-node``, or (``--sample``,
        ``--budget``) examined by the reference only."""
        return len(self.outcomes) + len(self.left_out) + len(self.unbuilt)

    @property
    def shared(self) -> list[Outcome]:
        """The layouts built on a few fake ranks because another proves their groups."""
        return [o for o in self.outcomes if o.shares is not None]

    @property
    def exit_code(self) -> int:
        """130 (SIGINT) or 143 (SIGTERM, 128 + 15 as a shell reports it) when stopped by a
        signal, else 1 when a layout failed, else 0."""
        if self.interrupted:
            return 130 if self.interrupted == "SIGINT" else 143
        return int(any(not o.passed for o in self.outcomes))


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
            label = tier_label(tier, result)
            row = rows.setdefault(
                (o.case.framework, label),
                {
                    "framework": o.case.framework,
                    "tier": label,
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

    def rank(row: dict[str, Any]) -> tuple[str, int, str]:
        tier = row["tier"].split(" ")[0]
        return row["framework"], order.get(tier, 99), row["tier"]

    return sorted(rows.values(), key=rank)


def tier_label(tier: str, result: Any) -> str:
    """``fake``, or ``fake on ranks 0,4,7`` for a layout built on a few ranks only."""
    ranks = getattr(result, "ranks", None)
    return tier if ranks is None else f"{tier} on ranks {','.join(map(str, ranks))}"


def summary_table(out: Any, report: Report) -> None:
    """Convention x tier: what was verified where, and what was proven by communication."""
    state = f", interrupted by {report.interrupted}" if report.interrupted else ""
    table = Table(
        title=f"sweep of world {report.world_size} on {', '.join(report.tiers)}"
        f"{' (real frameworks)' if report.real else ''}: "
        f"{report.done} of {report.total} layouts in {report.elapsed:.1f} s wall{state}",
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
        communicates = row["tier"].split(" ")[0] in COMMUNICATING
        proven = row["groups_proven"] if communicates else "– (no comm.)"
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
    shared = report.shared
    if shared:
        first = next(iter(shared[0].results.values()))
        ranks = getattr(first, "ranks", None)
        where = (
            "on every rank of the fake tier"
            if ranks is None
            else (f"on fake ranks {','.join(map(str, ranks))}")
        )
        out.print(
            f"{report.structures} distinct group structures: each was built on every rank; "
            f"the {len(shared)} layouts that repeat one were built {where} and diffed "
            "against their own reference, their groups proven on the first "
            "(--exhaustive builds every layout on every rank of the asked tier)"
        )
    if report.unbuilt:
        why = "--budget ran out" if report.budget_spent else "--sample"
        out.print(
            f"{len(report.unbuilt)} layouts were examined by the reference only ({why}): "
            "groups, findings and placement, no live build"
        )
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


def findings_of(outcome: Outcome) -> list[dict[str, str]]:
    """The worker's answer; computed here only for an outcome that came without one."""
    return outcome.findings if outcome.findings is not None else layout_findings(outcome.case)


def print_findings(out: Any, report: Report) -> None:
    """One line per convention whose layouts break an invariant, by check; nothing when none."""
    counts: dict[str, Counter[str]] = {}
    layouts = 0
    for o in report.outcomes:
        found = findings_of(o)
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
        "complete": report.interrupted is None
        and report.done == report.total
        and not report.budget_spent,
        "budget_spent": report.budget_spent,
        "distinct_group_structures": report.structures,
        "layouts_built": len(report.outcomes),
        "interrupted": report.interrupted,
        "layouts_total": report.total,
        "layouts_done": report.done,
        "passed": sum(o.passed for o in report.outcomes),
        "failed": sum(not o.passed for o in report.outcomes),
        "exit_code": report.exit_code,
        "summary": tier_rows(report),
        "placement": placement_json(report),
        "results": [_outcome_json(o, True) for o in report.outcomes]
        + [_outcome_json(o, False) for o in report.unbuilt],
    }


def _outcome_json(o: Outcome, built: bool) -> dict[str, Any]:
    return {
        "id": o.case.id,
        "framework": o.case.framework,
        "config": o.case.config,
        "built": built,
        "passed": o.passed,
        "agree": o.agree,
        "fingerprint": o.fingerprint,
        "shares_groups_with": None if o.shares is None else o.shares.case.id,
        "findings": findings_of(o),
        "crosses_nodes": None if o.placed is None else list(o.placed.crossing),
        "roles_crossing_nodes": None if o.placed is None else list(o.placed.roles),
        "tiers": {tier: {**result_json(r), "ranks": _ranks(r)} for tier, r in o.results.items()},
        "equivalence": None if o.step is None else o.step.as_json(),
    }


def _ranks(result: Any) -> list[int] | None:
    ranks = getattr(result, "ranks", None)
    return None if ranks is None else list(ranks)


def write_json(path: str, report: Report) -> None:
    """``-`` prints to stdout; else the file is written whole, then renamed into place."""
    data = report_json(report)
    if path == "-":
        render.print_json(data)
        return
    outputs.write(path, lambda stream: render.print_json(data, stream))


def write_junit(path: str, report: Report) -> None:
    """One testcase per layout verified (classname meshsim.sweep.<framework>), a failure per
    mismatch; an interrupted sweep adds an ``interrupted`` property and one error naming the
    signal. ``--gpus-per-node`` adds the question and how many layouts it left out."""
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
        ("layouts_done", report.done),
        ("interrupted", report.interrupted or ""),
        *placement_properties(report),
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
            message=f"sweep interrupted by {report.interrupted} after {report.done} of "
            f"{report.total} layouts",
        )
    tree = ET.ElementTree(suites)
    outputs.write(
        path, lambda stream: tree.write(stream, encoding="utf-8", xml_declaration=True), binary=True
    )
