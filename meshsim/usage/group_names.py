"""The reference's groups by their members: which kind names an observed group, what reaches a
rank through a sequence of reductions, and which collectives run over a group no kind has.

Pure: reads :class:`meshsim.Expected` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshsim.model.expected import ROLES, Expected
from meshsim.usage.trace_records import Collective

UNDEFINED = "a group the layout does not define"
WORLD = "the world"


def find_strays(collectives: Iterable[Collective], expected: Expected) -> tuple[Collective, ...]:
    """The collectives over a group that no kind of the reference has (the world excepted)."""
    return strays(collectives, GroupNames(expected))


def strays(collectives: Iterable[Collective], names: GroupNames) -> tuple[Collective, ...]:
    """``find_strays`` with the names already built (one index for many ranks)."""
    return tuple(
        c for c in collectives if not names.kinds_of(c.group) and not names.is_world(c.group)
    )


class GroupNames:
    """The reference's groups by members: which kinds have a group, and what ranks reach."""

    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self.world = frozenset(range(expected.world_size))
        # The gradient kind names a group first (Megatron's dp and dp-cp coincide without cp).
        first = ("gradient_reduce", *ROLES)
        order = [expected.roles[r] for r in first if r in expected.roles]
        order += [k for k in expected.kinds() if k not in order]
        self._kinds: dict[frozenset[int], list[str]] = {}
        for kind in dict.fromkeys(order):
            if not expected.kind(kind).available:
                continue
            for group in expected.groups(kind):
                self._kinds.setdefault(frozenset(group), []).append(kind)

    def kinds_of(self, group: Sequence[int]) -> list[str]:
        return self._kinds.get(frozenset(group), [])

    def is_world(self, group: Sequence[int]) -> bool:
        return frozenset(group) == self.world

    def name(self, group: Sequence[int], prefer: Sequence[str] = ()) -> str | None:
        """The kind naming ``group`` (a needed kind first), ``the world``, or ``None``."""
        kinds = self.kinds_of(group)
        for kind in prefer:
            if kind in kinds:
                return kind
        if kinds:
            return kinds[0]
        return WORLD if self.is_world(group) else None

    def reach(self, rank: int, kinds: Sequence[str]) -> frozenset[int]:
        """The ranks whose gradient reaches ``rank`` after reducing over ``kinds`` in order."""
        reached = {rank}
        for kind in reversed(kinds):
            if kind == WORLD:
                return self.world
            grown: set[int] = set()
            for member in reached:
                group = self.expected.group_of(member, kind)
                grown.update(group if group is not None else (member,))
            reached = grown
        return frozenset(reached)
