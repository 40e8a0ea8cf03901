"""Per-rank outcomes of a run and the failure messages built from them."""

from __future__ import annotations

import signal
import traceback as _tb
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Outcome statuses. ``ok``: the body returned. ``error``: it raised. ``died``: the rank's
#: process exited or was killed before reporting. ``timeout``: still running at the deadline.
#: ``aborted``: stopped by the harness because another rank failed first.
STATUSES = ("ok", "error", "died", "timeout", "aborted")


@dataclass(frozen=True)
class RankOutcome:
    """What one rank did: its return value, or how it failed, as plain data.

    Exceptions are kept as type name, message and formatted traceback (not as objects) so
    that outcomes cross process boundaries and survive exceptions that cannot be pickled.
    ``collective``: the collective the rank was in when it failed or was stopped. ``stack``:
    its Python stack when stopped. ``teardown``: how its process died after returning.
    ``output``: its last output when it died. ``pid``: its process (process tiers only).
    ``finding``: the structured result behind the error where there is one (a
    ``LayoutMismatch``'s ``MeshDiff``), so ranks that each saw part of one wrong layout (the
    fake tier cannot gather) are reported as one.
    """

    rank: int
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    exit_code: int | None = None
    signal_name: str | None = None
    status: str = "ok"
    collective: str | None = None
    stack: str | None = None
    teardown: str | None = None
    output: str | None = None
    pid: int | None = None
    finding: Any = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        """True when the body returned a value on this rank."""
        return self.status == "ok"

    def describe(self) -> str:
        """One line saying how this rank ended (without the rank number)."""
        if self.status == "ok":
            return "returned"
        if self.status == "error":
            return f"{self.error_type}: {self.error_message}"
        if self.status == "died":
            return f"died: {death_cause(self.exit_code, self.signal_name)}"
        where = f"in {self.collective}" if self.collective else "not in a collective"
        if self.status == "timeout":
            return f"still running at the deadline ({where})"
        return f"aborted after another rank failed ({where})"


class RunResult(list, Generic[T]):  # type: ignore[type-arg]
    """The list of per-rank return values (index = rank, or the order of ``ranks=``).

    A plain ``list`` for callers, plus what happened around the values: ``outcomes`` (every
    rank's ``RankOutcome``), ``teardown_failures`` (ranks whose process died in teardown
    after their value arrived; see ``TeardownWarning``), ``backend``, ``world_size`` and
    ``ranks``. On the fake tier also the recording: ``group_creations`` (the
    world-synchronised group creations, the same on every rank) and ``calls`` (rank ->
    its collectives and member-only group creations, as ``recorder.Call`` objects).
    """

    def __init__(
        self,
        outcomes: Sequence[RankOutcome],
        *,
        backend: str,
        world_size: int,
        teardown_failures: Sequence[RankOutcome] = (),
        group_creations: Sequence[Any] = (),
        calls: Mapping[int, Sequence[Any]] | None = None,
    ) -> None:
        super().__init__(o.value for o in outcomes)
        self.outcomes: tuple[RankOutcome, ...] = tuple(outcomes)
        self.ranks: tuple[int, ...] = tuple(o.rank for o in outcomes)
        self.backend = backend
        self.world_size = world_size
        self.teardown_failures: tuple[RankOutcome, ...] = tuple(teardown_failures)
        self.group_creations: tuple[Any, ...] = tuple(group_creations)
        self.calls: dict[int, tuple[Any, ...]] = {r: tuple(c) for r, c in (calls or {}).items()}


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11, falling back to ``signal <n>`` for unknown numbers."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def death_cause(exit_code: int | None, sig: str | None) -> str:
    """Human words for how a process ended: ``killed by SIGSEGV`` / ``exited with code 3``."""
    if sig:
        return f"killed by {sig}"
    if exit_code is None:
        return "vanished (exit status unknown)"
    return f"exited with code {exit_code}"


_HARNESS_DIR = __file__.rsplit("/", 1)[0] + "/"


def _trim(te: _tb.TracebackException) -> None:
    """Drop the harness's own frames (the caller of the body, the recorder's wrappers)."""
    frames = [f for f in te.stack if not f.filename.startswith(_HARNESS_DIR)]
    if frames:
        te.stack = _tb.StackSummary.from_list(frames)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _trim(chained)


def exception_fields(exc: BaseException) -> dict[str, Any]:
    """Type name, message and formatted traceback of ``exc`` as plain strings.

    The type name is the class's ``__qualname__`` (``AssertionError``, ``Skipped``); the
    traceback names the module. The harness's frames are dropped: it starts in the body.
    """
    te = _tb.TracebackException.from_exception(exc)
    _trim(te)
    fields = {
        "error_type": type(exc).__qualname__,
        "error_message": str(exc),
        "traceback": "".join(te.format()),
    }
    finding = getattr(exc, "diff", None)
    if callable(getattr(finding, "combined", None)):  # a LayoutMismatch's MeshDiff
        fields["finding"] = finding
    return fields


def trim_stack_text(text: str) -> str:
    """Drop harness and thread-bootstrap lines from a formatted or faulthandler stack."""
    out: list[str] = []
    skip_source = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("File "):
            skip_source = (
                _HARNESS_DIR in stripped
                or "/threading.py" in stripped
                or ('File "<string>"' in stripped)
            )
            if skip_source:
                continue
        elif skip_source and line.startswith("    "):
            continue  # the source line under a dropped "File ..." line
        else:
            skip_source = False
        out.append(line)
    return "".join(out)


def compress_ranks(ranks: Iterable[int]) -> str:
    """``0-3, 6, 8, 9``: runs of three or more ranks become ranges."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def rank_label(ranks: Iterable[int]) -> str:
    """``rank 2`` / ``ranks 2, 3`` / ``ranks 0-3``."""
    ordered = sorted(set(ranks))
    word = "rank" if len(ordered) == 1 else "ranks"
    return f"{word} {compress_ranks(ordered)}"


def format_group(group: Sequence[int] | None, world_size: int | None = None) -> str:
    """``the world`` (the default group) / ``group (0,1,2,3)``; long groups are shortened.

    A separate group that happens to span every rank is still shown as a group: collectives
    on it do not match collectives on the default group.
    """
    del world_size  # kept in the signature for callers that know it
    if group is None:
        return "the world"
    group = tuple(group)
    if len(group) <= 16:
        return "group (" + ",".join(map(str, group)) + ")"
    head = ",".join(map(str, group[:4]))
    return f"group ({head},...,{group[-1]}) [{len(group)} ranks]"


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip().splitlines(keepends=True)) + "\n"


def merge_outcomes(outcomes: Iterable[RankOutcome]) -> list[tuple[list[int], RankOutcome]]:
    """Group failed outcomes whose one-line description is identical, lowest rank first."""
    groups: dict[tuple[str, str], list[RankOutcome]] = {}
    for outcome in outcomes:
        if outcome.ok:
            continue
        groups.setdefault((outcome.status, outcome.describe()), []).append(outcome)
    merged = [(sorted(o.rank for o in members), members[0]) for members in groups.values()]
    # A death usually causes the errors of its peers (gloo: "Connection closed by peer").
    order = {"died": 0, "error": 1, "timeout": 2, "aborted": 3}
    merged.sort(key=lambda item: (order.get(item[1].status, 9), item[0][0]))
    return merged


def failure_message(header: str, outcomes: Sequence[RankOutcome], *, details: bool = True) -> str:
    """The text of a ``RankFailure``: one line per distinct failure, then tracebacks.

    Identical failures are merged (``ranks 2, 3: AssertionError: ...``); each merged group
    shows the traceback (or crash output / stack) of its lowest rank.
    """
    lines = [header]
    blocks: list[str] = []
    for ranks, first in merge_outcomes(outcomes):
        label = rank_label(ranks)
        if first.status == "died":
            lines.append(f"{label} {first.describe()}")
        else:
            lines.append(f"{label}: {first.describe()}")
        if not details:
            continue
        if first.traceback:
            blocks.append(f"--- traceback of rank {first.rank} ---\n" + _indent(first.traceback))
        if first.output and first.status == "died":
            blocks.append(f"--- last output of rank {first.rank} ---\n" + _indent(first.output))
        if first.stack and first.status in ("timeout", "aborted"):
            blocks.append(f"--- stack of rank {first.rank} ---\n" + _indent(first.stack))
    text = "\n".join(lines)
    if blocks:
        text += "\n\n" + "".join(blocks).rstrip()
    return text


def body_name(fn: Any) -> str:
    """``test_x.<locals>.body`` - how messages name the function a run executed."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def failure_error(
    outcomes: Sequence[RankOutcome], *, fn: Any, backend: str, world_size: int
) -> Exception | None:
    """A ``RankFailure`` describing every rank that did not return, or ``None``.

    Its first line is the finding (pytest's short summary and a JUnit message show only that
    line): the first distinct failure, then where it ran. ``tp groups differ: expected ...
    (ranks 0-7); meshsim.run(test_tp, world_size=8, backend='fake'): 8 of 8 ranks failed``.
    """
    from meshsim.errors import RankFailure

    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return None
    outcomes = combine_findings(outcomes)
    ranks, first = merge_outcomes(outcomes)[0]
    label = rank_label(ranks)
    said = first.describe().splitlines()[0]
    lead = f"{label} {said}" if first.status == "died" else f"{said} ({label})"
    if first.finding is not None:  # the finding alone (it names its ranks), not the diff's head
        lead = f"{first.error_type}: {first.finding.finding()}"
    header = (
        f"{lead}; meshsim.run({body_name(fn)}, world_size={world_size}, backend={backend!r}): "
        f"{len(failed)} of {len(outcomes)} ranks failed"
    )
    return RankFailure(failure_message(header, outcomes), tuple(outcomes))


def combine_findings(outcomes: Sequence[RankOutcome]) -> list[RankOutcome]:
    """Ranks that each raised part of one layout mismatch, raising the whole of it.

    A rank on the fake tier can only diff its own groups, so 8 ranks of one wrong mesh raise 8
    different ``LayoutMismatch`` es; the other tiers gather first and raise one. Combined, the
    report is the same on every tier: one block, every rank's mismatches in it.
    """
    parts = [o for o in outcomes if o.status == "error" and o.finding is not None]
    if len(parts) < 2 or len({o.error_message for o in parts}) == 1:
        return list(outcomes)
    whole = parts[0].finding.combined([o.finding for o in parts])
    text, merged = str(whole), {id(o) for o in parts}
    return [
        replace(o, error_message=text, finding=whole) if id(o) in merged else o for o in outcomes
    ]


def timeout_error(
    outcomes: Sequence[RankOutcome],
    *,
    fn: Any,
    backend: str,
    world_size: int,
    timeout: float,
    survivors: Sequence[int] = (),
    note: str = "",
    waits: Any = None,
) -> Exception:
    """A ``RankTimeout`` carrying every rank's stack and the collective it was blocked in.

    ``waits``: who waits for whom, read off the run's recordings (a ``waits.Waits``); the
    first line then leads with it, the same on every tier, and each stopped rank's line
    names the user's line it stands on.
    """
    from meshsim.errors import RankTimeout

    stuck = [o for o in outcomes if o.status == "timeout"]
    summary = (
        f"meshsim.run({body_name(fn)}, world_size={world_size}, backend={backend!r}) timed out "
        f"after {timeout:g} s; {rank_label(o.rank for o in stuck) if stuck else 'no rank'} "
        "still running, all ranks stopped"
    )
    try:
        finding = waits.finding() if waits is not None else None
    except Exception as exc:  # a report must never hide the timeout it reports
        finding = f"who waits for whom could not be worked out ({type(exc).__name__}: {exc})"
    lines = [f"{finding}; {summary}" if finding else summary]
    if survivors:
        lines.append(
            f"WARNING: {rank_label(survivors)} could not be stopped: their threads are still "
            "alive (parked as daemon threads; see meshsim.harness.threaded). Later threaded "
            "runs in this process refuse to start while they live; restart the interpreter."
        )
    if note:
        lines.append(note)
    for o in sorted(outcomes, key=lambda o: o.rank):
        if o.status == "timeout":
            where = f"blocked in {o.collective}" if o.collective else "not in a collective"
            site = waits.call_site(o.rank) if waits is not None else None
            lines.append(f"rank {o.rank}: {where}" + (f" at {site}" if site else ""))
        elif o.status == "ok":
            lines.append(f"rank {o.rank}: returned (waiting for the others)")
        else:
            lines.append(f"rank {o.rank}: {o.describe()}")
    blocks = [
        f"--- stack of rank {o.rank} ---\n" + _indent(o.stack)
        for o in sorted(outcomes, key=lambda o: o.rank)
        if o.stack and o.status in ("timeout", "aborted")
    ]
    blocks += [
        f"--- traceback of rank {o.rank} ---\n" + _indent(o.traceback)
        for o in sorted(outcomes, key=lambda o: o.rank)
        if o.traceback
    ]
    message = "\n".join(lines) + ("\n\n" + "".join(blocks).rstrip() if blocks else "")
    return RankTimeout(
        message,
        tuple(outcomes),
        stacks={o.rank: o.stack for o in outcomes if o.stack},
        collectives={o.rank: o.collective for o in outcomes if o.status == "timeout"},
        survivors=tuple(survivors),
        finding=finding,
        waits=dict(waits.waits) if waits is not None else None,
    )
