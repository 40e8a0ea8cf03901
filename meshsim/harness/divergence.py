"""Compare every rank's call recordings and name the first disagreement.

The fake tier feeds it as ranks run; the threaded and gloo tiers replay their recordings
into it after a run (``meshsim.harness.live.replay``).

Two rules, mirroring what makes real backends hang:

* world-synchronised group creations (``new_group``, DeviceMesh groups, ``split_group``)
  are collective over the whole world, so every rank must make the same ones in order;
* collectives on a group (and ``use_local_synchronization`` creations) must match in order
  among that group's members; ranks outside the group are not compared.

Point-to-point calls are not compared rank against rank (a send pairs with a recv): their
messages are matched per (source, destination, tag) by ``meshsim.harness.p2p``, and the
earliest mismatch of either check is reported. Groups are identified by their global ranks.
Creations are compared streaming against the first rank, so a 131,072 rank world that
builds thousands of groups per rank does not keep them all in memory.

Final and cut-short recordings. A run can end before every rank's sequence is known: a rank
raised, died, or was stopped. Such a rank's recording is *cut short*: every call in it is
evidence, but a call it lacks is not (it might have come). A rank whose sequence can have
no more calls is *final* (it returned, or ``meshsim.harness.deadlock`` proved it can never
leave the call it is blocked in): a call it lacks that a peer made is a divergence. So a
broken program is reported as the same divergence whether the run ended by a hang, a crash
or a normal return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshsim.errors import CollectiveDivergence
from meshsim.harness import p2p
from meshsim.harness.outcome import RankOutcome, format_group, rank_label
from meshsim.harness.recorder import Call, TrackingSink

Step = tuple[int, Call]


@dataclass(frozen=True)
class Divergence:
    """The first disagreement between two ranks (``a`` is the reference side)."""

    kind: str  # "creation" | "collective" | "p2p"
    group: tuple[int, ...] | None
    index: int
    rank_a: int
    rank_b: int
    side_a: str
    side_b: str
    step_a: int | None
    step_b: int | None
    what: str = ""  # p2p: the channel, index and problem (the message's middle)

    def first_step(self) -> int:
        steps = [s for s in (self.step_a, self.step_b) if s is not None]
        return min(steps) if steps else 0


def at_step(step: int, call: Call | None) -> str:
    """``tests/test_x.py:12 (step 3)``: the user's line that made the call, and its position;
    ``step 3`` when the line is unknown (a call made from torch's or meshsim's own code)."""
    where = call.where() if call is not None else None
    return f"{where} (step {step})" if where else f"step {step}"


def _key(call: Call) -> tuple:
    return (call.kind, call.op, call.group, call.local, call.meta)


class RankSink(TrackingSink):
    """The sink of one fake rank: numbers its calls and feeds the comparison."""

    def __init__(self, rank: int, comparison: Comparison) -> None:
        super().__init__()
        self.rank = rank
        self.step = 0
        self.calls: list[Step] = []
        self.p2p: list[Step] = []
        self._comparison = comparison

    def enter(self, call: Call) -> None:
        super().enter(call)
        step = self.step
        self.step += 1
        if call.kind == "p2p":
            self.p2p.append((step, call))
            return
        if call.kind == "create" and not call.local:
            self._comparison.creation(self.rank, step, call)
        elif call.kind == "create" and call.group is not None and self.rank not in call.group:
            return  # a local creation is a no-op for non-members
        else:
            self.calls.append((step, call))

    def created(self, calls: Sequence[Call]) -> None:
        """World-synchronised creations made in one step: compared in bulk."""
        if not calls:
            return
        self.count += len(calls)
        self.raised_id = self.raised_in = self.current = None
        self.last = calls[-1]
        self._comparison.creations(self.rank, self.step, calls)
        self.step += len(calls)


class Comparison:
    """Collects every fake rank's recording and finds the earliest divergence."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.order: list[int] = []
        self.calls: dict[int, list[Step]] = {}
        self.p2p: dict[int, list[Step]] = {}
        self.last_step: dict[int, int] = {}
        self.last_call: dict[int, Call | None] = {}
        self.final: set[int] = set()
        self.stuck: set[int] = set()  # final because deadlocked in their last call
        self._ref_rank: int | None = None
        self._ref_final = True
        self._ref: list[Step] = []
        self._index = 0
        self._diverged = False  # this rank's creations need no more comparing
        self.creation_divergence: Divergence | None = None

    def begin_rank(self, rank: int) -> RankSink:
        if self._ref_rank is None:
            self._ref_rank = rank
        self._index = 0
        self._diverged = False
        return RankSink(rank, self)

    def creation(self, rank: int, step: int, call: Call) -> None:
        if rank == self._ref_rank:
            self._ref.append((step, call))
            return
        if self._diverged:
            return
        k = self._index
        self._index += 1
        if k >= len(self._ref):
            self._diverged = True  # past a cut-short reference nothing is known
            if self._ref_final:
                self._note_creation(rank, k, (step, call))
        elif _key(self._ref[k][1]) != _key(call):
            self._diverged = True
            self._note_creation(rank, k, (step, call))

    def creations(self, rank: int, step: int, calls: Sequence[Call]) -> None:
        """``creation`` for consecutive steps ``step, step+1, ...``; the same calls as the
        reference's (the fast path shares one record per row across ranks) compare at C speed."""
        if rank == self._ref_rank:
            self._ref.extend(zip(range(step, step + len(calls)), calls))
            return
        k, n = self._index, len(calls)
        # ``==`` is stricter than ``_key``: equal calls mean no divergence.
        same = not self._diverged and k + n <= len(self._ref)
        if same and [c for _, c in self._ref[k : k + n]] == list(calls):
            self._index += n
            return
        for offset, call in enumerate(calls):
            self.creation(rank, step + offset, call)

    def end_rank(self, sink: RankSink, *, final: bool = True, stuck: bool = False) -> None:
        """Close ``sink``'s rank; ``final=False``: its recording was cut short (see above);
        ``stuck``: final because it is deadlocked in its last call, not because it returned."""
        if stuck:
            self.stuck.add(sink.rank)
        rank = sink.rank
        self.order.append(rank)
        self.calls[rank] = sink.calls
        self.p2p[rank] = sink.p2p
        self.last_step[rank] = sink.step - 1
        self.last_call[rank] = sink.current or sink.last
        if final:
            self.final.add(rank)
        if rank == self._ref_rank:
            self._ref_final = final
        elif final and not self._diverged and self._index < len(self._ref):
            self._note_creation(rank, self._index, None)

    def _note_creation(self, rank: int, k: int, mine: Step | None) -> None:
        if self.creation_divergence is not None:
            return
        assert self._ref_rank is not None
        ref = self._ref[k] if k < len(self._ref) else None
        self.creation_divergence = Divergence(
            "creation",
            None,
            k,
            self._ref_rank,
            rank,
            self._side(self._ref_rank, ref, "called", None),
            self._side(rank, mine, "called", None),
            ref[0] if ref else None,
            mine[0] if mine else None,
        )

    def _side(
        self,
        rank: int,
        step: Step | None,
        verb: str,
        other_step: int | None,
        sizes: bool = False,
    ) -> str:
        """What ``rank`` did at the divergence; ``sizes`` adds the shapes (all that differs)."""
        ws = self.world_size
        if step is not None:
            what = step[1].signature(ws) if sizes else step[1].describe(ws)
            return f"rank {rank} {verb} {what} at {at_step(*step)}"
        if other_step is not None:
            later = [s for s in self.calls.get(rank, []) if s[0] >= other_step]
            if later:
                s, call = later[0]
                return f"rank {rank} called {call.describe(ws)} at {at_step(s, call)} instead"
        last = self.last_step.get(rank, -1)
        if last < 0:
            return f"rank {rank} made no such call (it recorded no calls at all)"
        return f"rank {rank} made no such call ({self._absent(rank)})"

    # ------------------------------------------------------------------ groups

    def _group_divergences(self) -> list[Divergence]:
        sampled = set(self.order)
        position = {r: i for i, r in enumerate(self.order)}
        projections: dict[int, dict[tuple[int, ...] | None, list[Step]]] = {}
        for rank in self.order:
            per_group: dict[tuple[int, ...] | None, list[Step]] = {}
            for step in self.calls[rank]:
                per_group.setdefault(step[1].group, []).append(step)
            projections[rank] = per_group
        groups = {g for per in projections.values() for g in per}
        found: list[Divergence] = []
        for group in groups:
            if group is None:
                members = list(self.order)
            else:
                members = sorted((r for r in set(group) if r in sampled), key=position.__getitem__)
            if len(members) < 2:
                continue
            # The reference: the first final member (every index is comparable against a
            # final sequence), else the longest cut-short one.
            ref_rank = next(
                (r for r in members if r in self.final),
                max(members, key=lambda r: len(projections[r].get(group, []))),
            )
            members.remove(ref_rank)
            members.insert(0, ref_rank)
            ref = projections[ref_rank].get(group, [])
            for other in members[1:]:
                mine = projections[other].get(group, [])
                div = self._compare(group, ref_rank, ref, other, mine)
                if div is not None:
                    found.append(div)
                    break
        return found

    def _compare(
        self, group: tuple[int, ...] | None, a: int, ref: list[Step], b: int, mine: list[Step]
    ) -> Divergence | None:
        for k in range(max(len(ref), len(mine))):
            sa = ref[k] if k < len(ref) else None
            sb = mine[k] if k < len(mine) else None
            if sa is not None and sb is not None and _key(sa[1]) == _key(sb[1]):
                continue
            if (sa is None and a not in self.final) or (sb is None and b not in self.final):
                return None  # a cut-short rank may still have made this call
            sizes = sa is not None and sb is not None and sa[1].describe() == sb[1].describe()
            return Divergence(
                "collective",
                group,
                k,
                a,
                b,
                self._side(a, sa, "called", sb[0] if sb else None, sizes),
                self._side(b, sb, "called", sa[0] if sa else None, sizes),
                sa[0] if sa else None,
                sb[0] if sb else None,
            )
        return None

    def _p2p_divergences(self) -> list[Divergence]:
        """Point-to-point messages whose send and receive do not pair up (``p2p.mismatches``)."""
        if not any(self.p2p.values()):
            return []
        found = []
        for m in p2p.mismatches(self.p2p, self.world_size, final=self.final):
            what, side_send, side_recv = p2p.describe(m, self._absent)
            found.append(
                Divergence(
                    "p2p",
                    None,
                    m.index,
                    m.src if m.src >= 0 else m.dst,  # any-source: the receiver alone
                    m.dst,
                    side_send,
                    side_recv,
                    m.send.step if m.send else None,
                    m.recv.step if m.recv else None,
                    what,
                )
            )
        return found

    def _absent(self, rank: int) -> str:
        last = self.last_step.get(rank, -1)
        call = self.last_call.get(rank)
        if rank in self.stuck:
            return f"it is deadlocked in its call at {at_step(last, call)}"
        if last < 0:
            return "it recorded no calls at all"
        if call is not None and call.site is not None:
            return f"it returned after its call at {at_step(last, call)}"
        return f"it returned after step {last}"

    def group_creations(self) -> list[Call]:
        """The first rank's world-synchronised creations (every rank's, when none diverged)."""
        return [call for _, call in self._ref]

    def calls_by_rank(self) -> dict[int, list[Call]]:
        """Each rank's collectives and member-only creations, in order."""
        return {rank: [call for _, call in self.calls[rank]] for rank in self.order}

    def divergence(self, outcomes: Sequence[RankOutcome]) -> CollectiveDivergence | None:
        """The earliest divergence as an exception, or ``None`` when all ranks agree."""
        candidates = self._group_divergences() + self._p2p_divergences()
        if self.creation_divergence is not None:
            candidates.append(self.creation_divergence)
        if not candidates:
            return None
        # Earliest first; ties broken on content alone (a set's order may change between
        # processes), preferring a named group to the world.
        div = min(
            candidates,
            key=lambda d: (
                d.first_step(),
                d.kind != "creation",
                d.group is None,
                d.group or (),
                d.index,
                d.rank_a,
                d.rank_b,
            ),
        )
        hang = "on a real backend these ranks would hang here"
        if div.kind == "creation":
            what = f"the world-synchronised group creations at index {div.index}"
        elif div.kind == "p2p":
            what = div.what
            hang = "on a real backend this hangs, crashes or delivers wrong data"
        else:
            where = format_group(div.group, self.world_size)
            what = f"their calls on {where} at index {div.index} of that group's sequence"
        head = "point-to-point mismatch" if div.kind == "p2p" else "collective divergence"
        who = (
            f"ranks {div.rank_a} and {div.rank_b}"
            if div.rank_a != div.rank_b
            else rank_label((div.rank_a,))
        )
        message = (
            f"{head}: {who} disagree on {what}; "
            f"{hang}.\n  {div.side_a};\n  {div.side_b}.\n"
            "Lines are the calls' sites in your code; steps are 0-based positions in each "
            "rank's sequence of recorded calls (group creations, collectives and "
            "point-to-point calls)."
        )
        return CollectiveDivergence(
            message,
            tuple(outcomes),
            kind=div.kind,
            group=div.group,
            index=div.index,
            ranks=(div.rank_a, div.rank_b),
            calls=(div.side_a, div.side_b),
            steps=(div.step_a, div.step_b),
        )
