"""The plain values a rank's ``GradientTrace`` returns: picklable, checked in the parent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from meshsim.usage.param_roles import Marks

#: The recorder's suffix for a functional collective (DTensor's, compiled code's).
FUNCTIONAL = " (functional)"


class Collective(NamedTuple):
    """One collective on one rank: op, the group's global ranks, the user's ``file:line``."""

    op: str
    group: tuple[int, ...]
    site: str | None


@dataclass(frozen=True)
class ParamTrace:
    """One parameter with a gradient on one rank: its name, its marks (:class:`Marks`), the
    reductions of its gradient in order, the groups of the mesh dims it is a ``Replicate``
    DTensor on, and a note on why a wrapper reduced nothing (``None`` otherwise)."""

    name: str
    marks: Marks
    reductions: tuple[Collective, ...]
    replicated_over: tuple[tuple[int, ...], ...] = ()
    note: str | None = None


@dataclass(frozen=True)
class RankTrace:
    """What one rank's trace found: plain values, so a rank can return it from ``meshsim.run``."""

    rank: int
    world_size: int
    params: tuple[ParamTrace, ...]
    collectives: tuple[Collective, ...]
