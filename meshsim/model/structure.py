"""The sizes and strides that generate a family of groups, read off its ranks, and a formula.

A framework's groups at 131,072 ranks are 131,072 numbers, but almost always a two-line rule:
every group is one offset pattern (``members``) placed at a strided set of first ranks
(``starts``). :func:`structure_of` finds that rule and checks it rebuilds the very same groups,
so a summary (``meshsim show --json``, the pictures) can print the rule instead of the ranks and
never print a rule that is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from meshsim.model.groups import Groups
from meshsim.model.mesh_layout import Mode, _axis_modes, _offsets, coalesce

_MEMBER_LETTERS = "ijklmnpq"
_START_LETTERS = "abcdefgh"


@dataclass(frozen=True)
class Strided:
    """Ranks ``first + sum(c[d] * strides[d])`` for ``c[d] < sizes[d]``, outermost first.

    Example: ``Strided(0, (2, 4), (8, 1))`` reaches ``0, 1, 2, 3, 8, 9, 10, 11`` in that order.
    """

    first: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def ranks(self) -> npt.NDArray[np.int64]:
        return self.first + _offsets(list(zip(self.sizes, self.strides)))

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "sizes": list(self.sizes), "strides": list(self.strides)}


@dataclass(frozen=True)
class GroupStructure:
    """A family of groups as one pattern placed at many first ranks.

    Group ``g`` holds ``starts.ranks()[g] + members.ranks()`` in local-rank order (``members``
    has ``first`` 0). Example: Megatron's tp=2 groups on 8 ranks are ``members`` ``(2,):(1,)``
    placed at ``starts`` ``0 + (4,):(2,)``: ``ranks r + i (i < 2) for r = 2a (a < 4)``.
    """

    members: Strided
    starts: Strided

    def formula(self) -> str:
        """The rule in words: ``ranks r + 2i (i < 4) for r = 8a + b (a < 16, b < 2)``."""
        first, sizes, strides = self.starts.first, self.starts.sizes, self.starts.strides
        if not sizes:  # one group
            return (
                f"ranks {_sum(str(first) if first else '', self.members, _MEMBER_LETTERS) or '0'}"
            )
        inner = _sum("r", self.members, _MEMBER_LETTERS)
        if strides == (1,):  # consecutive first ranks read best as a range
            where = f"r < {sizes[0]}" if not first else f"{first} <= r < {first + sizes[0]}"
            return f"ranks {inner} for {where}"
        starts = _sum(str(first) if first else "", self.starts, _START_LETTERS)
        return f"ranks {inner} for r = {starts}"

    def to_json(self) -> dict[str, Any]:
        return {
            "members": {"sizes": list(self.members.sizes), "strides": list(self.members.strides)},
            "starts": self.starts.to_json(),
            "formula": self.formula(),
        }


def structure_of(groups: Groups) -> GroupStructure | None:
    """The sizes and strides that rebuild ``groups`` exactly, or None when none do.

    Every group must be the first group's offsets moved to its own first rank, and the first
    ranks (sorted: the order of groups carries no meaning) must be strided themselves. The
    candidate is rebuilt and compared with ``groups`` before it is returned.

    Example: ``structure_of(Groups([(0, 2), (1, 3), (4, 6), (5, 7)])).formula()`` is
    ``"ranks r + 2i (i < 2) for r = 4a + b (a < 2, b < 2)"``.
    """
    rows = groups.array
    if len(groups) == 0 or groups.group_size == 0:
        return None
    offsets = rows[0] - rows[0, 0]
    if not np.array_equal(rows - rows[:, :1], np.broadcast_to(offsets, rows.shape)):
        return None  # the groups are not one pattern moved around
    members = _strided(offsets)
    order = np.argsort(rows[:, 0], kind="stable")
    firsts = rows[order, 0]
    starts = _strided(firsts - firsts[0])
    if members is None or starts is None:
        return None
    found = GroupStructure(members, Strided(int(firsts[0]), starts.sizes, starts.strides))
    rebuilt = found.starts.ranks()[:, None] + found.members.ranks()[None, :]
    if not np.array_equal(rebuilt, rows[order]):
        return None  # never print a rule that does not give back these very groups
    return found


def _strided(offsets: npt.NDArray[np.int64]) -> Strided | None:
    """``offsets`` (from 0) as sizes and strides, when some reach exactly them in order."""
    if len(offsets) == 1:
        return Strided(0, (), ())
    modes: Sequence[Mode] = _axis_modes(offsets)
    if any(d == 0 for _, d in modes) or not np.array_equal(_offsets(modes), offsets):
        return None  # a stride of 0 repeats a rank: not a family of distinct groups
    modes = _tidy(modes)
    return Strided(0, tuple(s for s, _ in modes), tuple(d for _, d in modes))


def _tidy(modes: Sequence[Mode]) -> tuple[Mode, ...]:
    """Merged where contiguous (torch's coalesce), negative strides kept as they are."""
    if any(d < 0 for _, d in modes):
        return tuple(m for m in modes if m[0] != 1)
    return coalesce(modes)


def _sum(head: str, strided: Strided, letters: str) -> str:
    """``r + 2i + 8j (i < 4, j < 2)``: ``head`` plus one term per mode."""
    names = _names(len(strided.sizes), letters)
    terms = [head] if head else []
    for name, stride in zip(names, strided.strides):
        coefficient = "" if stride == 1 else "-" if stride == -1 else str(stride)
        terms.append(f"{coefficient}{name}")
    text = " + ".join(terms).replace("+ -", "- ")
    bounds = ", ".join(f"{name} < {size}" for name, size in zip(names, strided.sizes))
    return f"{text} ({bounds})" if bounds else text


def _names(count: int, letters: str) -> list[str]:
    if count <= len(letters):
        return list(letters[:count])
    return [f"{letters[0]}{d}" for d in range(count)]
