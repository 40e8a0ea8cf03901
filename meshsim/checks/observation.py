"""What one rank saw of its live groups: plain frozen data, picklable, free of torch objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Nested = Any  # nested lists of ints: a sub-mesh tensor as ``tensor.tolist()`` gives it


@dataclass(frozen=True)
class GroupView:
    """One group as one rank sees it.

    ``members`` are the process group's global ranks in group-rank order
    (``get_process_group_ranks``); ``gathered`` is what an all-gather of global ranks over the
    group returned (None when not proven, e.g. on the fake backend). ``mesh`` is the sub-mesh
    tensor for DeviceMesh dims; None for bare process groups.
    """

    name: str
    members: tuple[int, ...]
    local_rank: int
    mesh: Nested | None = None
    description: str | None = None
    gathered: tuple[int, ...] | None = None
    #: Set when this group's members do not all claim the same group ("ranks 0 and 2 disagree
    #: on tp: ..."); such a group is not proven by a collective, which would never complete.
    disagreement: str | None = None
    #: The backend of each dim's process group as ``dist.get_backend(group)`` names it (one
    #: entry for a process group); None when not observed. A ``fake`` group is never proven:
    #: it does not communicate.
    backends: tuple[str, ...] | None = None

    @property
    def proven(self) -> bool | None:
        """True when real communication returned exactly the members, in order."""
        return None if self.gathered is None else self.gathered == self.members


@dataclass(frozen=True)
class Observation:
    """Every group one rank holds, by name (mesh dims, flattened dims, named process groups)."""

    rank: int
    world_size: int
    backend: str
    groups: Mapping[str, GroupView] = field(default_factory=dict)
    mesh_dim_names: tuple[str, ...] = ()
    coordinate: tuple[int, ...] | None = None
    absent: tuple[str, ...] = ()  # named groups this rank is not a member of (e.g. embedding)

    def merged(self, other: Observation) -> Observation:
        """This observation plus ``other``'s groups (same rank): observe a mesh and PGs together."""
        if other.rank != self.rank:
            raise ValueError(f"cannot merge observations of ranks {self.rank} and {other.rank}")
        return Observation(
            self.rank,
            self.world_size,
            self.backend,
            {**self.groups, **other.groups},
            self.mesh_dim_names or other.mesh_dim_names,
            self.coordinate if self.coordinate is not None else other.coordinate,
            tuple(sorted(set(self.absent) | set(other.absent))),
        )
