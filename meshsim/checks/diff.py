"""Pure diff of observed groups against the reference: observations + Expected -> MeshDiff.

:class:`ObservedLayout` lives here, not beside :class:`Observation`: its ``==`` is this diff.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from meshsim.checks.observation import GroupView, Observation
from meshsim.errors import UsageError
from meshsim.harness.outcome import rank_label
from meshsim.model.expected import Expected, Kind
from meshsim.model.groups import Group, format_groups


@dataclass(frozen=True)
class ObservedLayout:
    """Observations of every rank (or a sample of ranks), one per rank, in rank order.

    ``observed == expected`` is True when :func:`meshsim.checks.diff` finds nothing, and pytest
    explains a failing ``assert observed == expected`` with the diff.
    """

    observations: tuple[Observation, ...]

    @classmethod
    def of(
        cls, observations: Iterable[Observation] | Observation | ObservedLayout
    ) -> ObservedLayout:
        if isinstance(observations, ObservedLayout):
            return observations
        if isinstance(observations, Observation):
            return cls((observations,))
        items = tuple(observations)
        bad = [type(o).__name__ for o in items if not isinstance(o, Observation)]
        if bad:
            raise TypeError(
                f"expected Observation objects (from meshsim.observe), got {sorted(set(bad))}"
            )
        return cls(tuple(sorted(items, key=lambda o: o.rank)))

    def __iter__(self) -> Iterator[Observation]:
        return iter(self.observations)

    def __len__(self) -> int:
        return len(self.observations)

    def names(self) -> list[str]:
        """Every group name observed on any rank, in first-seen order."""
        seen: dict[str, None] = {}
        for obs in self.observations:
            seen.update(dict.fromkeys(obs.groups))
            seen.update(dict.fromkeys(obs.absent))
        return list(seen)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Expected):
            return diff(self, other) is None
        if isinstance(other, ObservedLayout):
            return self.observations == other.observations
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Mismatch:
    """Ranks that saw the same wrong thing for one kind.

    ``aspect`` is ``members`` (wrong group), ``disagreement`` (the group's members each claim a
    different group), ``local_rank``, ``backend`` (a group built on another backend than the
    reference's, e.g. a real axis left ``fake``), ``proof`` (an all-gather over the group
    disagreed with its member list), ``missing`` (no group of that name on the rank) or
    ``unexpected`` (the framework raises for this kind, yet a group exists).
    """

    kind: str
    aspect: str
    ranks: tuple[int, ...]
    expected: Group | None
    observed: Group | None
    detail: str = ""

    @property
    def wrong_group(self) -> bool:
        """True when these ranks hold another group than the reference's (or none, or one
        where the framework refuses the kind): what a headline and the wrong-group count name.
        A disagreement counts when the rank's own claim is wrong, not when only a peer's is."""
        if self.aspect in ("members", "missing", "unexpected"):
            return True
        return self.aspect == "disagreement" and self.observed != self.expected

    def __str__(self) -> str:
        who = format_ranks(self.ranks)
        one = len(self.ranks) == 1
        holds = "holds" if one else "hold"
        if self.aspect == "members":
            return (
                f"{self.kind}: {who} {holds} {_fmt(self.observed)}; expected {_fmt(self.expected)}"
            )
        if self.aspect == "missing":
            has = "has" if one else "have"
            return f"{self.kind}: {who} {has} no group of this name; expected {_fmt(self.expected)}"
        if self.aspect == "unexpected":
            return f"{self.kind}: {who} {holds} {_fmt(self.observed)}; expected none, {self.detail}"
        return f"{self.kind}: {who}: {self.detail}"


@dataclass(frozen=True)
class MeshDiff:
    """Every mismatch between what ranks built and what the reference says, compactly."""

    expected: str
    mismatches: tuple[Mismatch, ...]
    checked: dict[str, int] = field(default_factory=dict)

    def ranks_affected(self, kind: str | None = None) -> tuple[int, ...]:
        """Every rank with at least one mismatch (of ``kind`` when given), sorted."""
        return tuple(
            sorted({r for m in self.mismatches if kind in (None, m.kind) for r in m.ranks})
        )

    def kinds(self) -> list[str]:
        """The kinds with a mismatch, in the order they were checked."""
        order = list(self.checked)
        found = {m.kind for m in self.mismatches}
        return sorted(found, key=lambda k: order.index(k) if k in order else len(order))

    def lines(self, limit: int = 4) -> list[str]:
        """A head line, then per kind: ranks affected, expected vs observed groups, and at most
        ``limit`` entries (ranks that saw the same wrong group are one entry).

        The length depends on the number of kinds, not on the world size, so a wrong layout at
        world 64 or 1,024 reads like one at world 8.
        """
        kinds = self.kinds()
        affected = self.ranks_affected()
        head = (
            f"{self.finding()}; {len(kinds)} of {len(self.checked)} kinds checked differ "
            f"({', '.join(kinds)}) on {_count(affected)} against {self.expected}:"
        )
        return [head, *(f"  {line}" for kind in kinds for line in self._kind_lines(kind, limit))]

    def combined(self, diffs: Iterable[MeshDiff]) -> MeshDiff:
        """One diff of what ``diffs`` found on their ranks (each rank of a fake run diffs its
        own groups): mismatches that are the same but for the ranks become one."""
        ranks: dict[tuple[str, str, Group | None, Group | None, str], set[int]] = {}
        checked: dict[str, int] = {}
        for part in diffs:
            for m in part.mismatches:
                key = (m.kind, m.aspect, m.expected, m.observed, m.detail)
                ranks.setdefault(key, set()).update(m.ranks)
            for kind, count in part.checked.items():
                checked[kind] = checked.get(kind, 0) + count
        mismatches = tuple(
            Mismatch(kind, aspect, tuple(sorted(who)), exp, obs, detail)
            for (kind, aspect, exp, obs, detail), who in ranks.items()
        )
        return MeshDiff(self.expected, mismatches, checked)

    def finding(self) -> str:
        """The first difference in one sentence, for the first line of a failure report
        (pytest's short summary, a JUnit message): ``tp groups differ: expected [(0, 1), (2,
        3), ... 2 more] observed [(0, 4), (1, 5), ... 2 more] on ranks 0-7``.

        It leads with the wrong groups themselves: the first kind (in check order) where some
        rank holds another group than the reference's, counting every such rank (a rank whose
        group its peers disagree with included). Only when no kind has a wrong group does it
        name a symptom (local ranks, backends, a failed all-gather proof)."""
        kinds = self.kinds()
        wrong_kinds = [k for k in kinds if any(m.wrong_group for m in self._of(k))]
        if wrong_kinds:
            kind = wrong_kinds[0]
            wrong = [m for m in self._of(kind) if m.wrong_group]
            who = sorted({r for m in wrong for r in m.ranks})
            return (
                f"{kind} groups differ: expected {_expected_text(wrong, 2)} "
                f"observed {_observed_text(wrong, 2)} on {format_ranks(who)}"
            )
        kind = kinds[0]
        found = self._of(kind)
        first = found[0]
        who = sorted({r for m in found if m.aspect == first.aspect for r in m.ranks})
        what = _ASPECT_HEADS.get(first.aspect, first.aspect)
        return f"{kind} {what} on {format_ranks(who)}: {first.detail}"

    def _of(self, kind: str) -> list[Mismatch]:
        return [m for m in self.mismatches if m.kind == kind]

    def kind_summary(self, kind: str) -> str:
        """One line for ``kind``: ranks in the wrong group, expected vs observed groups."""
        return self._kind_lines(kind, 4)[0]

    def _kind_lines(self, kind: str, limit: int) -> list[str]:
        found = [m for m in self.mismatches if m.kind == kind]
        if len(found) == 1:
            return [str(found[0])]
        out: list[str] = []
        wrong = [m for m in found if m.wrong_group]
        if wrong:
            who = sorted({r for m in wrong for r in m.ranks})
            out.append(
                f"{kind}: {_count(who)} in the wrong group ({format_ranks(who)}); expected "
                f"{_expected_text(wrong, limit)}; observed {_observed_text(wrong, limit)}"
            )
        for aspect in ("disagreement", "local_rank", "backend", "proof"):
            some = [m for m in found if m.aspect == aspect]
            if some:
                who = sorted({r for m in some for r in m.ranks})
                out.append(f"{kind}: {format_ranks(who)} [{aspect}]: {len(some)} distinct findings")
        out += [f"  {m}" for m in found[:limit]]
        if len(found) > limit:
            out.append(f"  ... {len(found) - limit} more for {kind}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


#: How :meth:`MeshDiff.finding` names an aspect that is not a wrong member list.
_ASPECT_HEADS = {
    "local_rank": "local ranks differ",
    "backend": "backend differs",
    "proof": "failed its all-gather proof",
}


def _count(ranks: Sequence[int]) -> str:
    return f"{len(ranks)} rank" + ("" if len(ranks) == 1 else "s")


def _groups_text(groups: Sequence[Group | None], limit: int) -> str:
    real = sorted({g for g in groups if g is not None})
    return format_groups(real, limit) if real else "no group"


def _side(pairs: Sequence[tuple[Group | None, Sequence[int]]], limit: int) -> str:
    """Groups one side names, and the ranks where that side names none, in one phrase:
    ``[(0, 1)] (no group on ranks 2, 3)``."""
    text = _groups_text([g for g, _ in pairs], limit)
    empty = sorted({r for g, ranks in pairs if g is None for r in ranks})
    if empty and text != "no group":
        text += f" (no group on {format_ranks(empty)})"
    return text


def _expected_text(wrong: Sequence[Mismatch], limit: int) -> str:
    """What the reference expects of the wrong ranks; where it expects a refusal, says so."""
    refused = [m for m in wrong if m.aspect == "unexpected"]
    if refused:
        return f"no group ({refused[0].detail})"
    return _side([(m.expected, m.ranks) for m in wrong], limit)


def _observed_text(wrong: Sequence[Mismatch], limit: int) -> str:
    return _side([(m.observed, m.ranks) for m in wrong], limit)


def format_ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-3, 8, 10, 11``: the harness's wording for rank sets."""
    return rank_label(ranks)


def _fmt(group: Group | None) -> str:
    if group is None:
        return "no group"
    return "(" + ", ".join(map(str, group)) + ("," if len(group) == 1 else "") + ")"


def _kinds_to_check(
    observed: ObservedLayout, expected: Expected, kinds: Iterable[str] | None
) -> list[str]:
    if kinds is not None:
        chosen = list(kinds)
        for name in chosen:
            expected.kind(name)  # raises for a name the reference does not know
        return chosen
    known = set(expected.kinds()) | set(expected.unavailable()) | set(expected.roles)
    chosen = [n for n in observed.names() if n in known]
    if not chosen:
        raise UsageError(
            f"nothing to compare: observed groups {observed.names()} share no name with "
            f"{expected.framework}'s kinds {list(expected.kinds())}; pass kinds=... or name the "
            "observed groups after the kinds"
        )
    return chosen


def _refusal(framework: str, name: str, ref: Kind) -> str:
    """Why the reference expects no group of ``name``: the framework refuses to build it."""
    error = ref.source
    raised = getattr(error, "upstream", None) or "an error"
    return f"the reference says {framework} refuses {name}: {raised}: {error}"


def _backend_finding(ref: Kind, view: GroupView, world_backend: str) -> str:
    """Why ``view`` sits on the wrong backend, or "" (also when it cannot be told: on the fake
    tier every group is fake, whatever the framework asked for)."""
    if view.backends is None or world_backend == "fake":
        return ""
    want = ref.backends_on(world_backend, len(view.backends))
    if view.backends == want:
        return ""

    def said(backend: str) -> str:
        return f"{backend} (the world's backend)" if backend == world_backend else backend

    if len(want) == 1:
        return f"backend {view.backends[0]}; expected {said(want[0])}"
    dims = ref.mesh_dims if len(ref.mesh_dims) == len(want) else range(len(want))
    wrong = [
        f"dim {dim} on {seen}, expected {said(wanted)}"
        for dim, seen, wanted in zip(dims, view.backends, want)
        if seen != wanted
    ]
    return "backends: " + "; ".join(wrong)


def diff(
    observations: Iterable[Observation] | Observation | ObservedLayout,
    expected: Expected,
    kinds: Iterable[str] | None = None,
) -> MeshDiff | None:
    """Compare observed groups with the reference, kind by kind, rank by rank; None when equal.

    ``kinds`` defaults to every observed name the reference knows (kind or role name).
    """
    observed = ObservedLayout.of(observations)
    names = _kinds_to_check(observed, expected, kinds)
    found: dict[tuple[str, str, Group | None, Group | None, str], list[int]] = {}

    def note(
        kind: str, aspect: str, rank: int, exp: Group | None, obs: Group | None, detail: str = ""
    ) -> None:
        found.setdefault((kind, aspect, exp, obs, detail), []).append(rank)

    for name in names:
        ref = expected.kind(name)
        for obs in observed:
            view = obs.groups.get(name)
            if not ref.available:
                if view is not None:
                    note(
                        name,
                        "unexpected",
                        obs.rank,
                        None,
                        view.members,
                        _refusal(expected.framework, name, ref),
                    )
                continue
            want = ref.group_of(obs.rank)
            if view is None:
                if name in obs.absent:
                    if want is not None:
                        note(name, "members", obs.rank, want, None)
                else:
                    note(name, "missing", obs.rank, want, None)
                continue
            if view.disagreement is not None:  # said first: the group itself is inconsistent
                note(name, "disagreement", obs.rank, want, view.members, view.disagreement)
                continue
            if view.members != want:
                note(name, "members", obs.rank, want, view.members)
                continue
            if view.local_rank != want.index(obs.rank):
                note(
                    name,
                    "local_rank",
                    obs.rank,
                    want,
                    view.members,
                    f"local rank {view.local_rank}; expected {want.index(obs.rank)}",
                )
            backend = _backend_finding(ref, view, obs.backend)
            if backend:  # one finding across groups: the backend is the kind's, not a group's
                note(name, "backend", obs.rank, None, None, backend)
            if view.gathered is not None and view.gathered != view.members:
                note(
                    name,
                    "proof",
                    obs.rank,
                    want,
                    view.members,
                    f"all-gather over the group returned {_fmt(view.gathered)}, not its members "
                    f"{_fmt(view.members)}",
                )
    if not found:
        return None
    mismatches = tuple(
        Mismatch(kind, aspect, tuple(ranks), exp, obs, detail)
        for (kind, aspect, exp, obs, detail), ranks in found.items()
    )
    return MeshDiff(repr(expected), mismatches, {n: len(observed) for n in names})
