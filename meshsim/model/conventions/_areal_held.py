"""Groups some of whose members do not hold them: AReaL's grid under a rank_mapping that breaks
rank order creates every group on every rank, yet hands a process its group only when the
process found its own coordinate."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from meshsim.model.groups import Groups


class HeldGroups(Groups):  # type: ignore[misc]  # Groups is final; see the class docstring
    """:class:`Groups` whose per-rank answers follow who *holds* a group, not who is in it.

    ``owner[r]`` is the row rank ``r`` holds (-1: none). The rows are every group created (the
    family compared as a set); ``group_of``/``local_rank`` answer the group a rank holds, so a
    member left without its group reads "no group", as on the live rank. A subclass because
    :class:`~meshsim.model.expected.Kind` asks its groups, not the kind, for a rank's group.
    """

    __slots__ = ("_owner",)

    def __init__(self, rows: npt.ArrayLike, owner: npt.NDArray[np.int64]) -> None:
        super().__init__(rows)
        owner = np.asarray(owner, dtype=np.int64)
        owner.flags.writeable = False
        self._owner = owner

    def _index(self) -> npt.NDArray[np.int64]:
        return self._owner

    def _local_ranks(self, world_size: int) -> npt.NDArray[np.int64]:
        out = super()._local_ranks(world_size)
        held = np.zeros(world_size, dtype=bool)
        size = min(world_size, self._owner.size)
        held[:size] = self._owner[:size] >= 0
        out[~held] = -1
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeldGroups, (self.array.tolist(), self._owner.tolist()))
