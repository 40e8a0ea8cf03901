"""What a rank hands back of one tensor: its numbers, dtype, and which slice of the full
tensor it holds. Plain data (numpy), so it crosses process boundaries and the comparison in
the parent never needs torch."""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Shard:
    """The slice of the full tensor a rank holds: chunk ``index`` of ``count`` along ``dim``."""

    dim: int
    index: int
    count: int

    def take(self, full: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """This shard's part of ``full``; ``ValueError`` when the shard does not divide it."""
        if self.dim >= full.ndim or full.shape[self.dim] % self.count:
            raise ValueError(
                f"a {self.count}-way shard along dim {self.dim} does not divide shape {full.shape}"
            )
        step = full.shape[self.dim] // self.count
        index = [slice(None)] * full.ndim
        index[self.dim] = slice(self.index * step, (self.index + 1) * step)
        return full[tuple(index)]


@dataclass(frozen=True)
class Captured:
    """One tensor (or number) on one rank at one point of the step.

    ``array`` is float32 for a floating tensor of 32 bits or fewer (each such value is exact
    there) and float64 otherwise; the comparison computes in float64 either way (``dtype``
    keeps the original, which picks the tolerance); ``shard`` is ``None`` for a full tensor;
    ``role`` is what the parameter is marked as (``"sequence_parallel"``, ``"expert"``, ...)
    and ``reduced`` the groups the :class:`~meshsim.usage.trace.GradientTrace` saw reduce a
    gradient (``None``: not traced), both used only to word a finding.

    Unpickled (in the caller, from each rank), equal arrays become one read-only array: every
    rank of a world records every full parameter, mostly the same numbers, and a world of 8
    would otherwise hold 8 copies of the model four times over.
    """

    array: npt.NDArray[np.floating]
    dtype: str
    shard: Shard | None = None
    role: str | None = None
    #: For a gradient on N ranks: the groups (global ranks) the trace saw reduce it this step.
    reduced: tuple[tuple[int, ...], ...] | None = None

    def expected_part(self, full: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return full if self.shard is None else self.shard.take(full)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unpickled, (self.array, self.dtype, self.shard, self.role, self.reduced)


#: The arrays unpickled so far, by content, while any record holds them.
_ARRAYS: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def _unpickled(array: Any, *fields: Any) -> Captured:
    return Captured(_one_copy(array), *fields)


def _one_copy(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The array already unpickled with the same dtype, shape and bytes, else ``array`` itself
    (made read-only: records are shared between ranks from here on)."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # not np.ascontiguousarray: it makes a 0-d array 1-d
    digest = hashlib.blake2b(array.data, digest_size=16).digest()
    key = (array.dtype.str, array.shape, digest)
    known = _ARRAYS.get(key)
    if known is not None and np.array_equal(known, array):
        return known
    array.flags.writeable = False
    _ARRAYS[key] = array
    return array


@dataclass(frozen=True)
class Snapshot:
    """One ``ctx.record(...)`` call: the logged values, gradients and parameters by name."""

    values: dict[str, Captured]
    grads: dict[str, Captured]
    params: dict[str, Captured]


@dataclass(frozen=True)
class RankTrail:
    """Everything one rank recorded: one snapshot per step, then the final parameters."""

    rank: int
    snapshots: tuple[Snapshot, ...]
    final: dict[str, Captured]
