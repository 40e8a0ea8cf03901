"""Node placement for ``sweep --gpus-per-node``: which kinds of a layout cross nodes, whether
the kinds ``--within-node`` names stay inside one, and how the sweep reports it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from meshsim.errors import LayoutError, UsageError
from meshsim.model.expected import ROLES, Expected
from meshsim.model.invariants import crossing_groups
from meshsim.model.sweep import LayoutCase

#: The sweep's report (``meshsim.cli.sweep_report.Report``), which imports this module.
Report = Any

#: Evenly spaced layouts per convention whose kinds ``--within-node`` names are checked
#: against, besides one layout per degree above one (see ``_sample``).
NAME_SAMPLE = 8


@dataclass(frozen=True)
class Question:
    """What ``--gpus-per-node G [--within-node K,K]`` asks of every layout of a sweep.

    ``within`` holds kind or role names; each is resolved per layout as
    :meth:`Expected.kind` resolves it (a kind of that name first, else a role), so
    ``("tensor",)`` asks the same of every convention while ``("tp",)`` names a kind of those
    that have one.
    """

    gpus_per_node: int
    within: tuple[str, ...] = ()

    def describe(self) -> str:
        """``tp, expert`` or ``every kind``: what must stay inside a node."""
        return ", ".join(self.within) if self.within else "every kind"


@dataclass(frozen=True)
class Placed:
    """One layout's answer: the kinds whose groups span nodes, and what each asked name is here.

    ``named`` maps each ``within`` name to the kind it resolves to in this layout, or None
    where the layout builds no such groups (a role it lacks, ``expert`` at ep=1); such a name
    cannot cross. Example: megatron ``tp=4`` on 16 ranks, 2 GPUs per node, asked
    ``("tensor",)``: ``crossing`` holds ``"tp"``, ``named`` is ``{"tensor": "tp"}``, ``roles``
    holds ``"tensor"``; not kept.
    """

    crossing: tuple[str, ...]
    named: dict[str, str | None]
    #: The roles whose kind is in ``crossing``: the same words on every convention.
    roles: tuple[str, ...] = ()

    @property
    def kept(self) -> bool:
        """Every named kind stays inside a node (always true when none is named)."""
        return not self.crossing_named()

    def crossing_named(self) -> list[str]:
        """The asked names whose kind crosses nodes here, in the order asked."""
        return [name for name, kind in self.named.items() if kind in self.crossing]


def parse_within(values: Sequence[str] | None) -> tuple[str, ...]:
    """``["tp,ep", "tensor"]`` (the flag, repeatable) -> ``("tp", "ep", "tensor")``, each once."""
    names: list[str] = []
    for value in values or ():
        names += [name.strip() for name in value.split(",") if name.strip()]
    return tuple(dict.fromkeys(names))


def place(expected: Expected | None, question: Question) -> Placed:
    """Answer ``question`` for one reference layout (None: one the reference refuses, which
    builds no group and so crosses nothing).

    The kinds checked are those a summary shows (``primary_kinds``: torchtitan's axes and
    role kinds, not each of its getter calls) plus every kind a ``within`` name resolves to.
    """
    if expected is None:
        return Placed((), dict.fromkeys(question.within), ())
    named = {name: _resolve(expected, name) for name in question.within}
    available = expected.kinds()
    checked = [k for k in expected.primary_kinds() if k in available]
    checked += [k for k in named.values() if k is not None and k not in checked]
    crossing = tuple(
        kind
        for kind in checked
        if len(crossing_groups(expected.groups(kind), question.gpus_per_node))
    )
    roles = tuple(role for role, kind in expected.roles.items() if kind in crossing)
    return Placed(crossing, named, roles)


def _resolve(expected: Expected, name: str) -> str | None:
    """The kind ``name`` stands for in this layout; None where it builds no such groups."""
    try:
        kind = expected.kind(name)
    except LayoutError:  # not a kind or role here, or a role the convention cannot tell
        return None
    return kind.name if kind.available else None


def validate_within(names: Iterable[str], cases: Sequence[LayoutCase]) -> None:
    """Raise :class:`UsageError` for a name that is neither a role nor a kind the swept
    conventions build, naming the valid ones (roles first: they mean the same everywhere).

    Kinds depend on the config (pipeline kinds appear only with pp > 1) and computing every
    layout's reference would cost as much as a fake sweep, so the kinds come from a sample of
    each convention's layouts (``_sample``: each degree above one at least once).
    """
    unknown = [name for name in names if name not in ROLES]
    if not unknown:
        return
    kinds = sampled_kinds(cases)
    unknown = [name for name in unknown if name not in kinds]
    if not unknown:
        return
    frameworks = ", ".join(dict.fromkeys(c.framework for c in cases))
    shown = sorted(kinds)
    listed = ", ".join(shown[:40]) + (f", ... {len(shown) - 40} more" if len(shown) > 40 else "")
    raise UsageError(
        f"--within-node: {', '.join(map(repr, unknown))} is neither a role nor a kind of "
        f"{frameworks}; roles (the same on every convention): {', '.join(ROLES)}; kinds: "
        f"{listed} (meshsim list F lists each convention's kinds)"
    )


def sampled_kinds(cases: Sequence[LayoutCase]) -> set[str]:
    """Kind names (available or not) of a sample of ``cases``, per convention."""
    by_framework: dict[str, list[LayoutCase]] = {}
    for case in cases:
        by_framework.setdefault(case.framework, []).append(case)
    kinds: set[str] = set()
    for found in by_framework.values():
        for case in _sample(found):
            try:
                expected = case.expect()
            except LayoutError:
                continue
            kinds |= set(expected.kinds()) | set(expected.unavailable())
    return kinds


def _sample(cases: Sequence[LayoutCase]) -> list[LayoutCase]:
    """``NAME_SAMPLE`` evenly spaced cases, plus for each integer config key (a degree) the
    first case where it is above one, plus the case with most degrees above one."""
    k = min(NAME_SAMPLE, len(cases))
    chosen = {round(i * (len(cases) - 1) / max(k - 1, 1)) for i in range(k)}
    above = [{key for key, value in c.config.items() if _degree(value) > 1} for c in cases]
    for key in set().union(*above):
        chosen.add(next(i for i, keys in enumerate(above) if key in keys))
    chosen.add(max(range(len(cases)), key=lambda i: len(above[i])))
    return [cases[i] for i in sorted(chosen)]


def _degree(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


# -- the report ------------------------------------------------------------------------------
#: Layouts ``--within-node`` keeps that the console lists by id, with their crossing kinds.
LISTED_KEPT = 20


def print_placement(out: Any, report: Report) -> None:
    """How many layouts keep the named kinds (or every kind) inside a node, per convention,
    with what crosses; with ``--within-node``, the kept layouts by id when there are few."""
    question = report.question
    if question is None:
        return
    examined = report.outcomes + report.left_out
    if question.within:
        kept = [o for o in examined if not o.left_out]
        tail_note = f"; the sweep verified those and left out {len(report.left_out)}"
    else:
        kept = [o for o in examined if o.placed is not None and not o.placed.crossing]
        tail_note = ""
    out.print(
        f"[bold]nodes of {question.gpus_per_node} GPUs[/bold]: {len(kept)} of {len(examined)} "
        f"layouts examined keep {question.describe()} inside a node{tail_note}"
    )
    crossing_what = "crossing nodes" if question.within else "roles crossing nodes"
    for row in placement_rows(report):
        counts = ", ".join(f"{name} in {n}" for name, n in row["crossing"].items())
        absent = f"; no layout has {', '.join(row['absent'])}" if row["absent"] else ""
        out.print(
            f"  {row['framework']}: {row['kept']} of {row['examined']} keep it; "
            f"{crossing_what}: {counts or 'none'}{absent}",
            markup=False,
        )
    if not question.within or not kept:
        return
    out.print(
        f"layouts that keep {question.describe()} inside a node, with the roles (else kinds) "
        "whose groups still cross nodes:"
    )
    for o in kept[:LISTED_KEPT]:
        out.print(f"  {o.case.id}  (crossing: {crossing_words(o.placed)})", markup=False)
    if len(kept) > LISTED_KEPT:
        out.print(f"  ... {len(kept) - LISTED_KEPT} more (--json lists each, with its kinds)")


def crossing_words(placed: Placed | None, most: int = 4) -> str:
    """What crosses nodes in one layout, in a few words: its roles (the same words on every
    convention), else its first kinds; ``none`` when all stays inside a node."""
    if placed is None or not placed.crossing:
        return "none"
    names = placed.roles or placed.crossing
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def placement_rows(report: Report) -> list[dict[str, Any]]:
    """Per convention: layouts examined and kept, how often each asked name (each role when
    none is named) crosses nodes, and the asked names none of its layouts has."""
    question = report.question
    rows: dict[str, dict[str, Any]] = {}
    seen: dict[str, set[str]] = {}
    for o in report.outcomes + report.left_out:
        if o.placed is None or question is None:
            continue
        row = rows.setdefault(
            o.case.framework,
            {"framework": o.case.framework, "examined": 0, "kept": 0, "crossing": Counter()},
        )
        row["examined"] += 1
        row["kept"] += not o.left_out
        if question.within:
            row["crossing"].update(o.placed.crossing_named())
            seen.setdefault(o.case.framework, set()).update(
                name for name, kind in o.placed.named.items() if kind is not None
            )
        else:
            row["crossing"].update(o.placed.roles)
    for framework, row in rows.items():
        row["crossing"] = dict(row["crossing"].most_common())
        have = seen.get(framework, set())
        row["absent"] = [n for n in (question.within if question else ()) if n not in have]
    return list(rows.values())


def placement_json(report: Report) -> dict[str, Any] | None:
    """The ``placement`` object of ``--json``: null without ``--gpus-per-node``."""
    question = report.question
    if question is None:
        return None
    return {
        "gpus_per_node": question.gpus_per_node,
        "within_node": list(question.within),
        "layouts_examined": report.done,
        "layouts_kept": len(report.outcomes),
        "layouts_left_out": len(report.left_out),
        "by_framework": placement_rows(report),
    }


def placement_properties(report: Report) -> list[tuple[str, object]]:
    """The JUnit properties of the question: G, the names, the layouts left out."""
    question = report.question
    if question is None:
        return []
    return [
        ("gpus_per_node", question.gpus_per_node),
        ("within_node", ",".join(question.within)),
        ("layouts_left_out", len(report.left_out)),
    ]
