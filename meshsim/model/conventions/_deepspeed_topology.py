"""DeepSpeed's ``ProcessTopology`` family and MoE rank tables, over :class:`Layout`, vectorised.

Mirrors ``deepspeed/runtime/pipe/topology.py`` and, in ``deepspeed/utils/groups.py``, the two
rank tables a MoE layer can get (``_create_expert_and_data_parallel`` without ``mp_size`` and
``_get_expert_parallel_ranks``), quirks included: ``get_dim`` of an unknown axis is 0,
``get_axis_comm_lists`` of an unknown axis is ``[]``, ``get_rank`` needs every axis.
"""

from __future__ import annotations

import keyword
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout


class ProcessTopology:
    """Ranks laid out row-major over named axes, the last axis fastest (DeepSpeed's class).

    Example: ``ProcessTopology(["pipe", "data", "model"], [2, 2, 2]).get_axis_comm_lists("pipe")``
    is ``[[0, 4], [1, 5], [2, 6], [3, 7]]`` and ``filter_match(pipe=0, data=1)`` is ``[2, 3]``.
    """

    __slots__ = ("ProcessCoord", "_axes", "_dims", "layout")

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) > len(dims):
            raise LayoutError(
                f"ProcessTopology got {len(axes)} axes {axes} but only {len(dims)} dims {dims}",
                upstream="IndexError",
            )
        if len(axes) < len(dims):
            # Upstream silently folds the extra dims into colliding coordinates.
            raise LayoutError(f"ProcessTopology got {len(dims)} dims {dims} for axes {axes}")
        bad = [a for a in axes if not _is_field(a)]
        repeated = sorted({a for a in axes if axes.count(a) > 1})
        if bad or repeated:
            raise LayoutError(
                f"ProcessTopology axes {axes} must be distinct identifiers (namedtuple fields); "
                f"invalid: {bad or repeated}",
                upstream="ValueError",
            )
        self._axes: Final = tuple(axes)
        self._dims: Final = tuple(int(d) for d in dims)
        self.layout: Final = Layout.from_topology(axes, dims)
        factory: Any = namedtuple
        self.ProcessCoord: Final[Any] = factory("ProcessCoord", axes)

    @property
    def axes(self) -> list[str]:
        return list(self._axes)

    @property
    def dims(self) -> list[int]:
        return list(self._dims)

    def world_size(self) -> int:
        return self.layout.world_size

    def get_axis_names(self) -> list[str]:
        return list(self._axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (DeepSpeed's quirk)."""
        return self._dims[self._axes.index(axis)] if axis in self._axes else 0

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate; partial coordinates raise (use ``filter_match``)."""
        if len(coord) != len(self._axes):
            raise LayoutError(
                f"get_rank() needs every axis {list(self._axes)}, got {sorted(coord)}; it does "
                "not take slices, use filter_match()",
                upstream="ValueError",
            )
        unknown = sorted(set(coord) - set(self._axes))
        if unknown:
            raise LayoutError(
                f"get_rank() got unknown axes {unknown}; axes are {list(self._axes)}",
                upstream="TypeError",
            )
        outside = {a: v for a, v in coord.items() if not 0 <= v < self.get_dim(a)}
        if outside:
            sizes = dict(zip(self._axes, self._dims))
            raise LayoutError(
                f"coordinate {coord} is outside the topology (sizes {sizes})",
                upstream="AssertionError",
            )
        return self.layout.rank(**coord)

    def get_coord(self, rank: int) -> Any:
        """``rank``'s coordinate as a ``ProcessCoord`` namedtuple."""
        if not 0 <= rank < self.world_size():
            raise LayoutError(f"rank {rank} not found in topology.", upstream="ValueError")
        return self.ProcessCoord(**self.layout.coordinate(rank))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Communicator groups along ``axis``, one per combination of the other axes (row-major);
        ``[]`` for an unknown axis."""
        if axis not in self._axes:
            return []
        rows: list[list[int]] = self.layout.groups_array(axis).tolist()
        return rows

    def comm_groups(self, *axes: str) -> Groups:
        """The groups along ``axes`` together, as :class:`Groups` (no Python lists)."""
        return self.layout.groups(*axes)

    def filter_match(self, **partial: int) -> list[int]:
        """Ranks whose coordinate matches every given axis, in rank order."""
        unknown = sorted(set(partial) - set(self._axes))
        if unknown:
            raise LayoutError(
                f"filter_match() got unknown axes {unknown}; axes are {list(self._axes)}",
                upstream="AttributeError",
            )
        return list(self.layout.filter(**partial))

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx`` (not a communicator group)."""
        if axis not in self._axes:
            raise LayoutError(
                f"{axis!r} is not an axis of this topology {list(self._axes)}",
                upstream="ValueError",
            )
        return self.filter_match(**{axis: idx})

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """``"model_01"``-style name of ``rank``'s coordinate, used in checkpoint file names."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}"
            for axis in self._axes
            if axis not in frozenset(omit_axes)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessTopology):
            return NotImplemented
        return self._axes == other._axes and self._dims == other._dims

    def __hash__(self) -> int:
        return hash((self._axes, self._dims))

    def __repr__(self) -> str:
        return f"ProcessTopology(axes={list(self._axes)}, dims={list(self._dims)})"


def _is_field(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
    )


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data"]``: data parallelism inside each pipeline stage."""

    __slots__ = ()

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data", "model"]`` (model fastest): Megatron order ``tp-dp-pp``."""

    __slots__ = ()

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n``, ascending with repeats: ``prime_factors(12) == [2, 2, 3]``."""
    if n <= 0:
        raise LayoutError("Values must be strictly positive.", upstream="ValueError")
    primes, candidate = [], 2
    while n > 1:
        while n % candidate == 0:
            primes.append(candidate)
            n //= candidate
        candidate += 1
    return primes


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """``PipelineParallelGrid``'s topology when none is given: the world's prime factors,
    ascending, dealt alternately to pipe (even positions) and data (odd positions).

    Example: 8 gives pipe 4 × data 2; 12 gives 6 × 2; 16 gives 4 × 4.
    """
    num_pp = num_dp = 1
    for index, prime in enumerate(prime_factors(world_size)):
        if index % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


def expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size: int,
    expert_parallel_size: int,
    pipeline_parallel_size: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[Groups, Groups]:
    """``_get_expert_parallel_ranks``: (expert-parallel groups, expert-data-parallel groups).

    Dense DP groups stride by tp inside each pipeline stage. E + D (default): each DP group is
    cut into consecutive chunks of ``ep`` ranks (the EP groups) and the chunks are zipped into
    expert-DP groups. D + E reorders each DP group first, so EP groups stride and expert-DP
    groups are local.

    Example: world 16, tp 2, ep 4 gives EP ``[0, 2, 4, 6]``, ``[8, 10, 12, 14]``, ``[1, 3, 5, 7]``,
    ``[9, 11, 13, 15]`` and expert DP ``[0, 8]``, ``[2, 10]``, ...
    """
    tp, ep, pp = tensor_parallel_size, expert_parallel_size, pipeline_parallel_size
    if world_size % (tp * pp):
        raise LayoutError(
            f"world size {world_size} is not divisible by tensor × pipeline parallel size "
            f"{tp}×{pp} = {tp * pp}",
            upstream="AssertionError",
        )
    dp = world_size // (tp * pp)
    if dp % ep:
        raise LayoutError(
            f"data-parallel size {dp} (world {world_size} / tp {tp} / pp {pp}) is not divisible "
            f"by expert parallel size {ep}",
            upstream="AssertionError",
        )
    # One dense DP group per (stage, tp lane), members ascending: shape (pp, tp, dp).
    dense = np.arange(world_size, dtype=np.int64).reshape(pp, dp, tp).transpose(0, 2, 1)
    if use_data_before_expert_parallel_:
        blocks = dense.reshape(pp, tp, ep, dp // ep)
        return Groups(blocks.swapaxes(-1, -2).reshape(-1, ep)), Groups(blocks.reshape(-1, dp // ep))
    blocks = dense.reshape(pp, tp, dp // ep, ep)
    return Groups(blocks.reshape(-1, ep)), Groups(blocks.swapaxes(-1, -2).reshape(-1, dp // ep))


def expert_and_data_parallel_ranks(
    world_size: int,
    expert_parallel_size: int,
    pipeline_parallel_size: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[Groups, Groups]:
    """``_create_expert_and_data_parallel(ep)`` with no ``mp_size`` (its "legacy" path):
    (expert-parallel groups, expert-data-parallel groups).

    The path of ``MoE(enable_expert_tensor_parallelism=False)`` (DeepSpeed's default) and of any
    MoE layer without an ``mpu``. Tensor parallelism is ignored: each pipeline stage's
    ``world / pp`` consecutive ranks are dealt like a tp-1 data-parallel group. E + D: EP groups
    are consecutive chunks of ``ep`` ranks, expert-DP groups stride by ``ep`` inside the stage.
    D + E: expert-DP groups are consecutive chunks of ``world / pp / ep``, EP groups stride by it.

    Example: world 8, ep 2 (whatever the tp) gives EP ``[0, 1]``, ``[2, 3]``, ``[4, 5]``, ``[6, 7]``
    and expert DP ``[0, 2, 4, 6]``, ``[1, 3, 5, 7]``.
    """
    ep, pp = expert_parallel_size, pipeline_parallel_size
    stage = world_size // pp
    if stage % ep:
        raise LayoutError(
            f"{stage} is not divisible by {ep}: _create_expert_and_data_parallel needs the ranks "
            f"of one pipeline stage (world {world_size} / pp {pp}) to be divisible by the expert "
            f"parallel size",
            upstream="AssertionError",
        )
    ranks, chunk = np.arange(world_size, dtype=np.int64), stage // ep
    if use_data_before_expert_parallel_:  # (stage, expert-DP chunk, position in it)
        blocks = ranks.reshape(pp, ep, chunk)
        return Groups(blocks.swapaxes(-1, -2).reshape(-1, ep)), Groups(blocks.reshape(-1, chunk))
    blocks = ranks.reshape(pp, chunk, ep)  # (stage, EP chunk, position in it)
    return Groups(blocks.reshape(-1, ep)), Groups(blocks.swapaxes(-1, -2).reshape(-1, chunk))
