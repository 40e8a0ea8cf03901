"""Groups: a family of rank groups held as one integer array, compared as a set."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, final

import numpy as np
import numpy.typing as npt

Group = tuple[int, ...]


class RankGroup(tuple):  # type: ignore[type-arg]
    """One group's ranks in local-rank order: a tuple that also equals the same ranks as a list.

    torch answers ``dist.get_process_group_ranks(pg)`` with a list, and the most natural line a
    test writes compares that list with the reference's group; a plain tuple never equals a
    list. Hashing stays the tuple's, so a group still works as a set member or dict key, and
    equal groups hash alike (a list, being unhashable, never needs to).
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return tuple.__eq__(self, tuple(other))
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankGroup, (tuple(self),))


def rank_group(ranks: Iterable[int]) -> RankGroup:
    """``ranks`` as a :class:`RankGroup` of Python ints."""
    return RankGroup(int(r) for r in ranks)


_SERIALS = itertools.count()


@final
class Groups:
    """A family of equally sized rank groups, one row per group, members in local-rank order.

    Two families are equal when they hold the same groups, whatever the order of the groups
    (frameworks enumerate them differently) but with the same order *inside* each group (that
    order is the local rank, so it matters).

    Example: a ``(dp, tp) = (2, 4)`` mesh has tp groups ``Groups([(0, 1, 2, 3), (4, 5, 6, 7)])``;
    ``groups.group_of(5) == (4, 5, 6, 7)`` and ``groups.local_rank(5) == 1``.
    """

    __slots__ = ("_first_index", "_memo", "_rows", "serial")

    def __init__(self, rows: Iterable[Iterable[int]] | npt.ArrayLike) -> None:
        array = np.asarray(rows if not isinstance(rows, Iterator) else list(rows), dtype=np.int64)
        if array.size == 0:
            array = array.reshape(0, 0)
        if array.ndim != 2:
            raise ValueError(
                f"groups must be a list of equally sized groups, got shape {array.shape}"
            )
        array.flags.writeable = False
        self._rows = array
        self._first_index: npt.NDArray[np.int64] | None = None
        self._memo: dict[Any, Any] = {}
        #: A number no other Groups object of this process has: it keys a :meth:`derived`
        #: answer that depends on a second family (``invariants``: containment, local ranks).
        self.serial: int = next(_SERIALS)

    @classmethod
    def from_array(cls, array: npt.NDArray[np.int64]) -> Groups:
        """Wrap a 2-D array without copying it (the caller gives up the right to change it)."""
        return cls(array)

    # -- container protocol ---------------------------------------------------------------
    @property
    def array(self) -> npt.NDArray[np.int64]:
        """The groups as a read-only ``(num_groups, group_size)`` int64 array."""
        return self._rows

    @property
    def group_size(self) -> int:
        return int(self._rows.shape[1])

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __iter__(self) -> Iterator[Group]:
        return iter(self.to_tuples())

    def __getitem__(self, index: int) -> Group:
        return RankGroup(self._rows[index].tolist())

    def __contains__(self, group: object) -> bool:
        """True when ``group`` (a tuple, list or :class:`RankGroup` of ranks) is one of these."""
        try:
            row = np.asarray(group, dtype=np.int64)
        except (TypeError, ValueError):
            return False
        if row.ndim != 1 or row.shape[0] != self.group_size or len(self) == 0:
            return False
        return bool((self._rows == row).all(axis=1).any())

    def to_tuples(self) -> tuple[Group, ...]:
        return tuple(map(RankGroup, self._rows.tolist()))

    def ranks(self) -> npt.NDArray[np.int64]:
        """Every member of every group, sorted (repeats kept)."""
        return np.sort(self._rows, axis=None)

    # -- per-rank queries -----------------------------------------------------------------
    def _index(self) -> npt.NDArray[np.int64]:
        """rank -> index of the first group holding it (-1 when none), built once."""
        if self._first_index is None:
            flat = self._rows.ravel()
            size = int(flat.max()) + 1 if flat.size else 0
            index = np.full(size, -1, dtype=np.int64)
            group_ids = np.repeat(np.arange(len(self), dtype=np.int64), self.group_size)
            # Reversed assignment so that the first group holding a rank wins.
            index[flat[::-1]] = group_ids[::-1]
            self._first_index = index
        return self._first_index

    def _row_of(self, rank: int) -> int:
        index = self._index()
        if 0 <= rank < index.size:
            return int(index[rank])
        return -1

    def group_of(self, rank: int) -> Group | None:
        """The first group holding ``rank``, or None when no group holds it."""
        row = self._row_of(rank)
        return None if row < 0 else self[row]

    def local_rank(self, rank: int) -> int | None:
        """``rank``'s position inside its group, or None when no group holds it."""
        row = self._row_of(rank)
        if row < 0:
            return None
        return int(np.flatnonzero(self._rows[row] == rank)[0])

    def local_ranks(self, world_size: int) -> npt.NDArray[np.int64]:
        """Local rank of every rank ``0..world_size-1`` (-1 when in no group), vectorised;
        read-only, worked out once per world size."""
        return self.derived(("local_ranks", world_size), self._local_ranks, world_size)

    def _local_ranks(self, world_size: int) -> npt.NDArray[np.int64]:
        out = np.full(world_size, -1, dtype=np.int64)
        positions = np.broadcast_to(np.arange(self.group_size, dtype=np.int64), self._rows.shape)
        out[self._rows[::-1].ravel()] = positions[::-1].ravel()
        return out

    def derived(self, key: Any, compute: Callable[..., Any], *args: Any) -> Any:
        """``compute(*args)``, worked out once per ``key`` for this family and kept with it.

        A family is immutable, and a sweep asks the same questions of the same family many
        times (the layouts of a world share a few hundred families: ``Layout.groups`` hands
        out one object per family), so answers are kept, never recomputed. A numpy answer
        is made read-only: it is shared.
        """
        try:
            return self._memo[key]
        except KeyError:
            value = compute(*args)
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
            self._memo[key] = value
            return value

    # -- set semantics --------------------------------------------------------------------
    def canonical(self) -> npt.NDArray[np.int64]:
        """Rows sorted lexicographically: the form two equal families share (read-only)."""
        return self.derived("canonical", self._canonical)  # type: ignore[no-any-return]

    def _canonical(self) -> npt.NDArray[np.int64]:
        if len(self) == 0:
            return self._rows
        firsts = self._rows[:, 0]
        order = np.argsort(firsts, kind="stable")
        if len(self) > 1 and (firsts[order][1:] == firsts[order][:-1]).any():
            order = np.lexsort(self._rows.T[::-1])  # rows sharing a first rank: full order
        return self._rows[order]

    def is_partition_of(self, world_size: int) -> bool:
        """True when every rank ``0..world_size-1`` sits in exactly one group."""
        answer: bool = self.derived(("partition", world_size), self._is_partition_of, world_size)
        return answer

    def _is_partition_of(self, world_size: int) -> bool:
        if self._rows.size != world_size:
            return False
        if world_size == 0:
            return True
        flat = self._rows.ravel()
        if flat.min() < 0 or flat.max() >= world_size:
            return False
        return bool((np.bincount(flat, minlength=world_size) == 1).all())

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, Groups):
            try:
                other = Groups(other)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return NotImplemented
        return self._rows.shape == other._rows.shape and np.array_equal(
            self.canonical(), other.canonical()
        )

    def __hash__(self) -> int:
        return hash((self._rows.shape, self.canonical().tobytes()))

    def __repr__(self) -> str:
        head = map(tuple, self._rows[:8].tolist())
        return f"Groups({format_groups(head, total=len(self))})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Groups, (self._rows.tolist(),))


class FamilyTable:
    """One :class:`Groups` object per family, by a key that decides its rows, so that what is
    worked out for a family (``Groups.derived``) is worked out once however many layouts
    make it. Bounded: the oldest families go past ``kept`` families or ``budget`` bytes of
    rows, and a family of more than ``largest`` bytes (a world of over 131,072 ranks) is
    never kept: hashing it would cost more than its answers. Safe to share between rank
    threads."""

    def __init__(self, kept: int = 4096, budget: int = 64 << 20, largest: int = 1 << 20) -> None:
        self._kept, self._budget, self._largest = kept, budget, largest
        self._families: dict[Any, Groups] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def keeps(self, size: int) -> bool:
        """Whether a family of ``size`` bytes of rows would be kept."""
        return size <= self._largest

    def get(self, key: Any, make: Callable[[], Groups]) -> Groups:
        """The family kept under ``key``, made by ``make()`` the first time."""
        found = self._families.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._families.get(key)
            if found is not None:
                return found
            found = make()
            found._memo["shared"] = True  # handed out by the table: never looked up again
            size = found._rows.nbytes
            if not self.keeps(size):
                return found
            while self._families and (
                len(self._families) >= self._kept or self._bytes + size > self._budget
            ):
                oldest = self._families.pop(next(iter(self._families)))
                self._bytes -= oldest._rows.nbytes
            self._families[key] = found
            self._bytes += size
        return found

    def share(self, groups: Groups) -> Groups:
        """The family kept with ``groups``' rows (``groups`` itself the first time). A
        subclass (``HeldGroups``: who holds a group matters too) is never shared."""
        if type(groups) is not Groups or groups._memo.get("shared"):
            return groups
        rows = groups._rows
        if not self.keeps(rows.nbytes):
            return groups
        return self.get((rows.shape, rows.tobytes()), lambda: groups)


#: The families of every reference layout, shared (``Layout.groups``, ``Kind.groups``).
FAMILIES = FamilyTable()


def format_groups(groups: Iterable[Group], limit: int = 8, total: int | None = None) -> str:
    """``[(0, 1), (2, 3), ... 6 more]`` with at most ``limit`` groups spelled out."""
    shown: list[str] = []
    seen = 0
    for group in groups:
        seen += 1
        if len(shown) < limit:
            shown.append("(" + ", ".join(map(str, group)) + ("," if len(group) == 1 else "") + ")")
    total = seen if total is None else total
    more = f", ... {total - len(shown)} more" if total > len(shown) else ""
    return "[" + ", ".join(shown) + more + "]"
