"""Compare two layouts role by role (and kind by kind): which ranks each puts together."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from meshsim.model.expected import ROLES, Expected
from meshsim.model.groups import Group, Groups

SAME = "same"
REORDERED = "same ranks, other order"
DIFFERENT = "different"
ONLY_A = "only in A"
ONLY_B = "only in B"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Comparison:
    """One role (or kind) compared between layout A and layout B.

    ``ranks`` counts the ranks whose group differs (members, or order for ``REORDERED``);
    ``example`` is one such rank with its group in A and in B.
    """

    name: str
    kind_a: str | None
    kind_b: str | None
    verdict: str
    ranks: int = 0
    example: tuple[int, Group | None, Group | None] | None = None
    shape_a: tuple[int, int] | None = None  # (#groups, group size)
    shape_b: tuple[int, int] | None = None
    sample: tuple[Group, ...] = ()  # A's first groups, to show what "same" looks like

    @property
    def differs(self) -> bool:
        return self.verdict not in (SAME,)

    def to_json(self) -> dict[str, Any]:
        example = None
        if self.example is not None:
            rank, a, b = self.example
            example = {"rank": rank, "a": a, "b": b}
        return {
            "name": self.name,
            "kind_a": self.kind_a,
            "kind_b": self.kind_b,
            "verdict": self.verdict,
            "ranks": self.ranks,
            "example": example,
            "shape_a": self.shape_a,
            "shape_b": self.shape_b,
        }


def _matches(
    a: Groups, b: Groups, world: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Per rank: does B give it a group of the same members as A, and in the same order?

    O(ranks) whatever the group size: each A group is looked up in B through B's owner index
    (no per-rank copies of whole groups, so 64k ranks in 1k-rank groups stay cheap).
    """
    from meshsim.cli.render import owners

    owner_a, owner_b = owners(a, world), owners(b, world)
    in_a, in_b = owner_a >= 0, owner_b >= 0
    members = ~in_a & ~in_b  # ranks neither layout groups agree
    exact = members.copy()
    if len(a) and len(b) and a.group_size == b.group_size:
        mapped = owner_b[a.array]  # B's group of every member of every A group
        target = mapped[:, 0]
        same_set = (mapped == target[:, None]).all(axis=1) & (target >= 0)
        same_order = same_set & (a.array == b.array[np.maximum(target, 0)]).all(axis=1)
        ranks_in_a = np.flatnonzero(in_a)
        group = owner_a[ranks_in_a]
        agree = owner_b[ranks_in_a] == target[group]
        members[ranks_in_a] = same_set[group] & agree
        exact[ranks_in_a] = same_order[group] & agree
    return members, exact


def compare_groups(a: Groups, b: Groups, world: int) -> tuple[str, int, int | None]:
    """(verdict, #ranks differing, first differing rank) for two group families.

    Example: Megatron world 8 tp=2 under orders tp-cp-ep-dp-pp and tp-cp-pp-ep-dp: ``dp``
    groups (0, 2, 4, 6) vs (0, 4) differ on every rank.
    """
    members, exact = _matches(a, b, world)
    if exact.all():
        return SAME, 0, None
    if members.all():
        bad = np.flatnonzero(~exact)
        return REORDERED, int(bad.size), int(bad[0])
    bad = np.flatnonzero(~members)
    return DIFFERENT, int(bad.size), int(bad[0])


def _compare(
    name: str, a: Expected, kind_a: str | None, b: Expected, kind_b: str | None
) -> Comparison:
    if kind_a is None or kind_b is None:
        return Comparison(name, kind_a, kind_b, ONLY_A if kind_b is None else ONLY_B)
    ka, kb = a.kind(kind_a), b.kind(kind_b)
    if not (ka.available and kb.available):
        return Comparison(name, kind_a, kind_b, UNAVAILABLE)
    ga, gb = ka.groups(), kb.groups()
    verdict, count, rank = compare_groups(ga, gb, a.world_size)
    example = None if rank is None else (rank, ga.group_of(rank), gb.group_of(rank))
    return Comparison(
        name,
        kind_a,
        kind_b,
        verdict,
        count,
        example,
        (len(ga), ga.group_size),
        (len(gb), gb.group_size),
        tuple(ga[i] for i in range(min(2, len(ga)))),
    )


def compare_roles(a: Expected, b: Expected) -> list[Comparison]:
    """Every role either layout has, in ROLES order."""
    return [
        _compare(role, a, a.roles.get(role), b, b.roles.get(role))
        for role in ROLES
        if role in a.roles or role in b.roles
    ]


def compare_kinds(a: Expected, b: Expected) -> list[Comparison]:
    """Kinds of the same name (two configs of one framework), A's order then B's extras."""
    names_a = list(a.kinds()) + list(a.unavailable())
    names_b = list(b.kinds()) + list(b.unavailable())
    names = names_a + [n for n in names_b if n not in names_a]
    return [
        _compare(n, a, n if n in names_a else None, b, n if n in names_b else None) for n in names
    ]


def any_difference(comparisons: Iterable[Comparison]) -> bool:
    return any(c.verdict in (DIFFERENT, REORDERED) for c in comparisons)
