"""Catch diverging ranks *before* the mismatched collective runs, for tiers that share memory.

torch's threaded backend pairs calls by arrival, not by kind: rank 0's ``all_reduce`` meets
the other ranks' ``barrier`` and everyone returns. So the threaded tier cannot rely on a hang
to expose a broken program. Every rank thread checks each call against a shared table keyed by
(group, position in that group's sequence): the first rank to get there registers its call,
the others compare, and a mismatch raises ``CollectiveDivergence`` in the rank that noticed
(the backend then aborts the world, so nobody waits for it).

Each sink also keeps its full sequence, which ``replay`` feeds to the fake tier's post-run
``Comparison``: that catches a rank that skipped a collective while the others completed.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

from meshsim.errors import CollectiveDivergence
from meshsim.harness.deadlock import WORLD_CREATIONS, deadlocked
from meshsim.harness.divergence import Comparison, _key
from meshsim.harness.outcome import RankOutcome, format_group, rank_label
from meshsim.harness.recorder import Call, TrackingSink


class LiveTable:
    """Signature per (group, index), shared by every rank thread of one run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._first: dict[tuple, tuple[int, Call]] = {}
        self.divergence: CollectiveDivergence | None = None
        self.closed = False  # the harness is stopping the run: later calls are not the body's

    def check(self, rank: int, slot: tuple, index: int, call: Call) -> None:
        with self._lock:
            if self.closed:
                return
            if self.divergence is not None:  # the run is already broken: do not start more
                raise copy.copy(self.divergence)  # each rank's traceback its own
            seen = self._first.setdefault(slot, (rank, call))
            if seen[0] == rank or _key(seen[1]) == _key(call):
                return
            self.divergence = self._error(slot, index, seen, (rank, call))
        raise copy.copy(self.divergence)

    def _error(
        self, slot: tuple, index: int, a: tuple[int, Call], b: tuple[int, Call]
    ) -> CollectiveDivergence:
        ws = self.world_size
        if slot[0] is WORLD_CREATIONS:
            kind, group = "creation", None
            what = f"the world-synchronised group creations at index {index}"
        else:
            kind, group = "collective", slot[0]
            where = format_group(group, ws)
            what = f"their calls on {where} at index {index} of that group's sequence"
        side_a, side_b = (
            f"rank {r} called {c.signature(ws)}" + (f" at {c.where()}" if c.site else "")
            for r, c in (a, b)
        )
        message = (
            f"collective divergence (caught live on the threaded tier, before the call ran): "
            f"ranks {a[0]} and {b[0]} disagree on {what}; on a real backend these ranks "
            f"would hang or exchange wrong data here.\n  {side_a};\n  {side_b}."
        )
        return CollectiveDivergence(
            message,
            kind=kind,
            group=group,
            index=index,
            ranks=(a[0], b[0]),
            calls=(side_a, side_b),
        )


class LiveSink(TrackingSink):
    """One rank thread's sink: checks each call live and keeps the sequence for ``replay``."""

    def __init__(self, rank: int, table: LiveTable) -> None:
        super().__init__()
        self.rank = rank
        self.table = table
        self.calls: list[Call] = []
        self._counts: dict[object, int] = {}

    def enter(self, call: Call) -> None:
        super().enter(call)
        self.calls.append(call)
        if call.kind == "p2p":
            return
        if call.kind == "create" and not call.local:
            slot_group: object = WORLD_CREATIONS
        elif call.kind == "create" and call.group is not None and self.rank not in call.group:
            return
        else:
            slot_group = call.group
        index = self._counts.get(slot_group, 0)
        self._counts[slot_group] = index + 1
        self.table.check(self.rank, (slot_group, index), index, call)


def replay(
    world_size: int,
    sequences: Iterable[tuple[int, Sequence[Call]]],
    *,
    final: Collection[int] | None = None,
    stuck: Collection[int] = (),
) -> Comparison:
    """Feed recorded per-rank sequences to the comparison the fake tier uses.

    ``final``: the ranks whose sequences are complete (default: all); the others were cut
    short (``meshsim.harness.divergence``); ``stuck``: the final ranks that are deadlocked
    rather than returned. The creation reference goes first: the lowest final rank, else the
    rank that recorded most.
    """
    by_rank = dict(sequences)
    order = sorted(by_rank)
    if final is not None and order:
        first = next(
            (r for r in order if r in final),
            max(order, key=lambda r: sum(c.kind == "create" for c in by_rank[r])),
        )
        order.remove(first)
        order.insert(0, first)
    comparison = Comparison(world_size)
    for rank in order:
        sink = comparison.begin_rank(rank)
        for call in by_rank[rank]:
            sink.enter(call)
            sink.exit(call)
        comparison.end_rank(sink, final=final is None or rank in final, stuck=rank in stuck)
    return comparison


def judge(
    world_size: int,
    calls: Mapping[int, Sequence[Call]],
    outcomes: Sequence[RankOutcome],
    blocked: Mapping[int, Call | None],
) -> CollectiveDivergence | None:
    """The divergence every rank's recording proves, however the run ended; else ``None``.

    ``calls``: each rank's recorded calls; ``blocked``: each rank still running when the run
    was judged -> the call it was inside (``None``: outside any call). Ranks that returned
    are final, so are the deadlocked ones (``meshsim.harness.deadlock``); a rank that raised
    or died was cut short.
    """
    returned = {o.rank for o in outcomes if o.ok}
    stuck = deadlocked(world_size, calls, blocked, returned)
    final = stuck | returned
    comparison = replay(world_size, sorted(calls.items()), final=final, stuck=stuck)
    return comparison.divergence(outcomes)


class DivergenceWatch:
    """Judges a running world each time it stands still, so that a divergence which leaves
    ranks waiting forever stops the run when it happens, not at the deadline.

    Standing still: no rank recorded a call since the last look. A run is stopped only when
    some rank is deadlocked (``meshsim.harness.deadlock``) and the recordings prove a
    divergence: ranks that can still move are left to finish, so a program that completes
    despite a divergence returns every rank's value with the report. Judging backs off to
    keep its cost under a tenth of the run's time on big recordings. Only the moment of the
    stop depends on the schedule; the verdict is ``judge``'s on the recordings.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.found: CollectiveDivergence | None = None
        #: Every rank still in its body was deadlocked at the last look: after a failure,
        #: nothing is left to wait for.
        self.standstill = False
        self._last_count = -1
        self._judged: object = None
        self._not_before = 0.0

    def look(
        self,
        calls: Mapping[int, Sequence[Call]],
        returned: Collection[int],
        blocked: Mapping[int, Call | None],
    ) -> CollectiveDivergence | None:
        """The divergence the recordings prove now, if the world stands still; else None."""
        count = sum(len(c) for c in calls.values())
        quiet, self._last_count = count == self._last_count, count
        if not quiet or not blocked:
            self.standstill = False
            return None
        state = (count, frozenset(returned), frozenset((r, id(c)) for r, c in blocked.items()))
        if state == self._judged or time.monotonic() < self._not_before:
            return None
        self._judged = state
        start = time.monotonic()
        stuck = deadlocked(self.world_size, calls, blocked, returned)
        self.standstill = len(deadlocked(self.world_size, calls, blocked)) == len(blocked)
        if stuck:
            final = stuck | set(returned)
            comparison = replay(self.world_size, sorted(calls.items()), final=final, stuck=stuck)
            self.found = comparison.divergence(())
        self._not_before = time.monotonic() + 10 * (time.monotonic() - start)
        return self.found


def ending_of_run(diverged: bool, timed_out: bool, timeout: float) -> str:
    """How a run that showed a divergence ended, for ``with_consequence``."""
    if diverged:
        return (
            "the harness stopped it as soon as the recordings proved the divergence; on a "
            "real backend the waiting ranks would hang"
        )
    if timed_out:
        return f"it timed out after {timeout:g} s"
    return "a rank failed or died, and the harness stopped the others"


def with_consequence(
    divergence: CollectiveDivergence, outcomes: Sequence[RankOutcome], ending: str
) -> CollectiveDivergence:
    """``divergence`` with how the run ended appended (the hang or crash it caused)."""
    lines = [f"What the run did: {ending}."]
    for ranks, first in _merged(outcomes):
        lines.append(f"  {rank_label(ranks)}: {_ending_of(first)}")
    consequence = "\n".join(lines)
    err = CollectiveDivergence(
        f"{divergence.args[0]}\n{consequence}",
        tuple(outcomes),
        kind=divergence.kind,
        group=divergence.group,
        index=divergence.index,
        ranks=divergence.ranks,
        calls=divergence.calls,
        steps=divergence.steps,
    )
    err.consequence = consequence
    return err


def _merged(outcomes: Sequence[RankOutcome]) -> list[tuple[list[int], RankOutcome]]:
    groups: dict[str, list[RankOutcome]] = {}
    for o in outcomes:
        groups.setdefault(_ending_of(o), []).append(o)
    merged = [(sorted(o.rank for o in g), g[0]) for g in groups.values()]
    return sorted(merged, key=lambda item: item[0][0])


def _ending_of(o: RankOutcome) -> str:
    where = f"in {o.collective}" if o.collective else "not in a collective"
    if o.status == "ok":
        return "returned"
    if o.status == "error":
        first = (o.error_message or "").strip().splitlines()
        text = f"raised {o.error_type}: {first[0] if first else ''}".rstrip(": ")
        return text + (f" (in {o.collective})" if o.collective else "")
    if o.status == "died":
        return o.describe()
    if o.status == "timeout":
        return f"still running at the deadline ({where})"
    return f"stopped by the harness ({where})"
