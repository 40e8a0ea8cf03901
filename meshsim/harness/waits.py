"""Who waits for whom when a run is stopped at its deadline: the first line of a ``RankTimeout``.

"timed out after 30 s; ranks 0-7 still running" leaves the reader to work out from eight
stacks that ranks 0, 2, 4, 6 wait in an all_gather for rank 5, which sleeps outside any
collective. The recordings already say it: a rank blocked in a call of a group's sequence
waits for the members that have not made that call (or made another one there); a blocked
``send``/``recv`` to one peer waits for that peer's matching call. This module states it:

    ranks 0, 2, 4, 6 wait in all_gather on group (0,2,4,5,6) at test_x.py:12 for rank 5;
    rank 5 is outside any collective at test_x.py:9 (time.sleep(0.01))

(one line). Waiting ranks are grouped by call, line and the ranks they wait for; then each
awaited rank that is not itself waiting is said once: outside any collective (its stack's
innermost user line), in another call, returned, raised or died. When every awaited rank
waits itself, the line says the ranks wait in a cycle. Everything is sorted by rank and read
from the recordings and stacks the same way on every tier, so one program gets one line on
threaded, gloo and fake. Where nothing is known (no rank inside a recorded call it waits in)
the line says so and where the running ranks are. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from meshsim.harness.deadlock import WORLD_CREATIONS, _channel_ops, members, slot_of
from meshsim.harness.divergence import _key
from meshsim.harness.outcome import RankOutcome, rank_label
from meshsim.harness.recorder import Call
from meshsim.harness.sites import format_site, stack_site

#: At most this many groups of waiting ranks, and of awaited ranks, in the line.
MAX_CLAUSES = 4


class Waits:
    """Who waits for whom among the ranks of a stopped run.

    ``calls``: every rank's recorded calls up to the stop; ``blocked``: each rank still in its
    body when stopped -> the call it was inside (``None``: outside any call); ``outcomes``:
    every rank's outcome (its status, and the stack of a stopped rank); ``unfollowed``: ranks
    whose bodies made calls from threads of their own, so which call they wait in is unknown.
    """

    def __init__(
        self,
        world_size: int,
        calls: Mapping[int, Sequence[Call]],
        blocked: Mapping[int, Call | None],
        outcomes: Sequence[RankOutcome],
        *,
        unfollowed: Collection[int] = (),
    ) -> None:
        self.world_size = world_size
        self.calls = calls
        self.unfollowed = frozenset(unfollowed)
        self.blocked = {r: c for r, c in blocked.items() if r not in self.unfollowed}
        self.outcomes = {o.rank: o for o in outcomes}
        self._made: dict[int, dict[object, list[Call]]] = {}
        #: Blocked rank -> the ranks it waits for (only ranks shown to wait for someone).
        self.waits: dict[int, tuple[int, ...]] = {}
        for rank in sorted(blocked):
            awaited = self._awaited(rank, blocked[rank])
            if awaited:
                self.waits[rank] = awaited

    # ------------------------------------------------------------------ who waits

    def _made_on(self, rank: int, slot: object) -> list[Call]:
        if rank not in self._made:
            per_slot: dict[object, list[Call]] = {}
            for call in self.calls.get(rank, ()):
                s = slot_of(rank, call)
                if s is not None:
                    per_slot.setdefault(s, []).append(call)
            self._made[rank] = per_slot
        return self._made[rank].get(slot, [])

    def _awaited(self, rank: int, call: Call | None) -> tuple[int, ...]:
        """The ranks ``rank`` waits for inside ``call``; empty when unknown or none."""
        sequence = self.calls.get(rank, ())
        if call is None or not sequence or sequence[-1] is not call or call.async_op:
            return ()
        slot = slot_of(rank, call)
        if slot is None:
            return self._p2p_awaited(rank, call)
        made = self._made_on(rank, slot)
        index = len(made) - 1
        peers: Iterable[int] = members(slot, self.world_size)
        if slot is WORLD_CREATIONS and call.op == "new_group" and call.group is not None:
            peers = call.group
        missing = []
        for m in peers:
            theirs = self._made_on(m, slot)
            if m != rank and (len(theirs) <= index or _key(theirs[index]) != _key(call)):
                missing.append(m)
        return tuple(sorted(missing))

    def _p2p_awaited(self, rank: int, call: Call) -> tuple[int, ...]:
        if len(call.ops) != 1 or call.ops[0].peer is None:
            return ()  # a batch or a receive from any source: not followed
        op = call.ops[0]
        mine = _channel_ops(self.calls.get(rank, ()), op.peer, op.sends, op.tag)
        theirs = _channel_ops(self.calls.get(op.peer, ()), rank, not op.sends, op.tag)
        return (op.peer,) if theirs < mine else ()

    # ------------------------------------------------------------------ where ranks are

    def call_site(self, rank: int) -> str | None:
        """The user's line ``rank`` stands on: its blocked call's, else its stack's."""
        call = self.blocked.get(rank)
        if call is not None and call.site is not None:
            return format_site(call.site)
        outcome = self.outcomes.get(rank)
        site = stack_site(outcome.stack if outcome else None)
        return None if site is None else format_site(site, source=call is None)

    def _state(self, rank: int) -> str:
        """What ``rank`` is doing, as a predicate: ``is outside any collective at x.py:3``."""
        outcome = self.outcomes.get(rank)
        if outcome is None:
            return "was not run"
        if outcome.status == "ok":
            return "already returned"
        if outcome.status == "error":
            first = (outcome.error_message or "").strip().splitlines()
            said = f": {first[0][:80]}" if first and first[0] else ""
            return f"raised {outcome.error_type}{said}"
        if outcome.status == "died":
            return outcome.describe()
        at = self.call_site(rank)
        at = f" at {at}" if at else ""
        if rank in self.unfollowed:
            return f"runs threads of its own (which call it waits in is unknown){at}"
        call = self.blocked.get(rank)
        if call is not None:
            return f"is in {call.describe(self.world_size)}{at}"
        if rank not in self.blocked and outcome.collective:
            return f"is in {outcome.collective}{at}"
        return f"is outside any collective{at or ' (where is unknown)'}"

    # ------------------------------------------------------------------ the line

    def finding(self) -> str:
        """The one-line account of who waits for whom (see the module's docstring)."""
        running = sorted(r for r, o in self.outcomes.items() if o.status == "timeout")
        if not self.waits:
            states = _grouped((r, self._state(r)) for r in running)
            where = "; ".join(_clauses(states))
            head = "no rank waits in a recorded collective or send/recv for another"
            return f"{head}; {where}" if where else head
        clauses: dict[tuple[str, str | None, tuple[int, ...]], list[int]] = {}
        for rank, awaited in self.waits.items():
            call = self.blocked[rank]
            assert call is not None
            key = (call.describe(self.world_size), self.call_site(rank), awaited)
            clauses.setdefault(key, []).append(rank)
        waiting = sorted(clauses.items(), key=lambda item: min(item[1]))
        parts = [
            f"{rank_label(ranks)} {_verb(ranks, 'waits', 'wait')} in {what}"
            + (f" at {at}" if at else "")
            + f" for {rank_label(awaited)}"
            for (what, at, awaited), ranks in waiting[:MAX_CLAUSES]
        ]
        if len(waiting) > MAX_CLAUSES:
            parts.append(f"{len(waiting) - MAX_CLAUSES} more groups of ranks wait")
        awaited_ranks = {r for awaited in self.waits.values() for r in awaited}
        culprits = sorted(awaited_ranks - set(self.waits))
        if culprits:
            parts += _clauses(_grouped((r, self._state(r)) for r in culprits))
        else:
            parts.append("each waits for another: a cycle no rank can leave")
        return "; ".join(parts)


def _verb(ranks: Sequence[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _predicate(ranks: Sequence[int], state: str) -> str:
    if state.startswith("is "):
        state = _verb(ranks, "is ", "are ") + state[3:]
    return f"{rank_label(ranks)} {state}"


def _grouped(items: Iterable[tuple[int, str]]) -> list[tuple[list[int], str]]:
    groups: dict[str, list[int]] = {}
    for rank, state in items:
        groups.setdefault(state, []).append(rank)
    return sorted(((sorted(r), s) for s, r in groups.items()), key=lambda item: item[0][0])


def _clauses(groups: list[tuple[list[int], str]]) -> list[str]:
    out = [_predicate(ranks, state) for ranks, state in groups[:MAX_CLAUSES]]
    if len(groups) > MAX_CLAUSES:
        rest = sorted(r for ranks, _ in groups[MAX_CLAUSES:] for r in ranks)
        out.append(f"{rank_label(rest)} elsewhere")
    return out
