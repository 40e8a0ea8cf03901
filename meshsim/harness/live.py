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

import threading
from collections.abc import Iterable

from meshsim.errors import CollectiveDivergence
from meshsim.harness.divergence import Comparison, _key
from meshsim.harness.outcome import format_group
from meshsim.harness.recorder import Call, TrackingSink

_WORLD_CREATIONS = ("world-synchronised creations",)


class LiveTable:
    """Signature per (group, index), shared by every rank thread of one run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._first: dict[tuple, tuple[int, Call]] = {}
        self.divergence: CollectiveDivergence | None = None

    def check(self, rank: int, slot: tuple, index: int, call: Call) -> None:
        with self._lock:
            if self.divergence is not None:  # the run is already broken: do not start more
                raise self.divergence
            seen = self._first.setdefault(slot, (rank, call))
            if seen[0] == rank or _key(seen[1]) == _key(call):
                return
            err = self._error(slot, index, seen, (rank, call))
            if self.divergence is None:
                self.divergence = err
        raise err

    def _error(
        self, slot: tuple, index: int, a: tuple[int, Call], b: tuple[int, Call]
    ) -> CollectiveDivergence:
        ws = self.world_size
        if slot[0] is _WORLD_CREATIONS:
            kind, group = "creation", None
            what = f"the world-synchronised group creations at index {index}"
        else:
            kind, group = "collective", slot[0]
            where = format_group(group, ws)
            what = f"their calls on {where} at index {index} of that group's sequence"
        side_a = f"rank {a[0]} called {a[1].signature(ws)}"
        side_b = f"rank {b[0]} called {b[1].signature(ws)}"
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
            slot_group: object = _WORLD_CREATIONS
        elif call.kind == "create" and call.group is not None and self.rank not in call.group:
            return
        else:
            slot_group = call.group
        index = self._counts.get(slot_group, 0)
        self._counts[slot_group] = index + 1
        self.table.check(self.rank, (slot_group, index), index, call)


def replay(world_size: int, sequences: Iterable[tuple[int, list[Call]]]) -> Comparison:
    """Feed recorded per-rank sequences to the post-run comparison the fake tier uses."""
    comparison = Comparison(world_size)
    for rank, calls in sequences:
        sink = comparison.begin_rank(rank)
        for call in calls:
            sink.enter(call)
            sink.exit(call)
        comparison.end_rank(sink)
    return comparison
