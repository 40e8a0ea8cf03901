"""megatron-core's rank arithmetic (RankGenerator and the extra group families), vectorised."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final, final

import numpy as np
import numpy.typing as npt

from meshsim.errors import LayoutError
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout

#: RankGenerator's axis names, in the order its constructor checks (and appends) them.
TOKENS: Final = ("tp", "pp", "dp", "ep", "cp")

IntArray = npt.NDArray[np.int64]


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> IntArray:
    """All groups spanning the masked axes, as a ``(num_groups, group_size)`` array.

    ``parallel_size`` lists the axis sizes fastest first (Megatron's order string); a group
    holds the ranks that differ only on masked axes. Group index and in-group index both run
    with the first axis fastest, so groups come out ascending and so do the ranks inside each.
    No Python loop over ranks: the world is one row-major grid (slowest axis first) and the
    groups are one transpose and one reshape of it.

    Example: sizes ``[2, 3, 4]`` (tp, dp, pp) with mask ``[False, True, False]`` gives dp groups
    ``[0, 2, 4]``, ``[1, 3, 5]``, ... ``[19, 21, 23]``.
    """
    sizes = [int(s) for s in parallel_size]
    if len(mask) != len(sizes):
        raise LayoutError(
            f"mask {list(mask)} has {len(mask)} entries but parallel_size {sizes} has {len(sizes)}"
        )
    if math.prod(sizes) != world_size:
        raise LayoutError(
            f"parallel_size {sizes} covers {math.prod(sizes)} ranks, not world_size {world_size}"
        )
    names = [f"axis{i}" for i in range(len(sizes))]
    masked = [n for n, m in zip(names, mask) if m]
    if not masked:
        # An empty mask means groups of one rank each (Megatron's group_size is 1).
        return np.arange(world_size, dtype=np.int64).reshape(-1, 1)
    layout = Layout(list(zip(reversed(names), reversed(sizes))))
    return layout.groups_array(*masked)


def parse_order(order: str, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The full token list RankGenerator works with: ``order`` lowercased, then every axis
    missing from it appended as the slowest (only allowed for size-1 axes)."""
    if not isinstance(order, str):
        raise LayoutError(f"order must be a string such as 'tp-cp-ep-dp-pp', got {order!r}")
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in sizes]
    if unknown:
        raise LayoutError(
            f"order {order!r} holds token(s) {unknown} that megatron-core does not know; "
            f"tokens are {'-'.join(sizes)} (KeyError upstream)",
            upstream="KeyError",
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        # Upstream accepts this and then builds groups over a grid larger than the world.
        raise LayoutError(
            f"order {order!r} repeats {repeated}; each axis may appear once (megatron-core "
            "does not check this and builds inconsistent groups)"
        )
    for name, size in sizes.items():
        if name not in tokens:
            if size != 1:
                raise LayoutError(
                    f"order {order!r} leaves out {name!r}, whose size is {size}; only axes of "
                    f"size 1 may be left out (megatron-core raises 'The size of ({name}) is "
                    f"({size}), but you haven't specified the order'). Add {name!r} to the order.",
                    upstream="RuntimeError",
                )
            tokens.append(name)
    return tuple(tokens)


@final
class RankGenerator:
    """megatron-core's ``RankGenerator``: one order string, five axis sizes, groups by token.

    ``get_ranks("dp-cp")`` returns every group spanning dp and cp (the token order inside the
    string is irrelevant). ``rank_offset`` is added to every rank, as upstream.

    Example: ``RankGenerator(tp=2, ep=1, dp=3, pp=4, cp=1, order="tp-dp-pp").get_ranks("dp")``
    holds ``(0, 2, 4)``, ``(1, 3, 5)`` ... ``(19, 21, 23)``.
    """

    __slots__ = ("layout", "order", "rank_offset")

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        if ep != 1 and cp != 1:
            raise LayoutError(
                f"a RankGenerator takes EP or CP, not both (ep={ep}, cp={cp}); megatron-core keeps "
                "CP in the decoder generator and EP in the expert generator",
                upstream="AssertionError",
            )
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.order: Final = "-".join(parse_order(order, sizes))
        self.layout: Final = Layout.from_order(self.order, **sizes)
        self.rank_offset: Final = int(rank_offset)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def dims(self, token: str) -> tuple[str, ...]:
        """The axes ``token`` spans, slowest first (the layout's root order)."""
        names = token.split("-")
        unknown = [t for t in names if t not in self.layout.root_names]
        if unknown:
            raise LayoutError(
                f"token {token!r} names {unknown}, which are not in order {self.order!r}",
                upstream="ValueError",
            )
        return tuple(d for d in self.layout.root_names if d in names)

    def get_ranks(self, token: str) -> Groups:
        """All groups spanning the axes of ``token`` (e.g. ``"tp-dp"``)."""
        if not self.rank_offset:
            return self.layout.groups(*self.dims(token))  # shared with every equal family
        return Groups.from_array(self.layout.groups_array(*self.dims(token)) + self.rank_offset)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={self.layout.size_of(n)}" for n in TOKENS)
        return f"RankGenerator({sizes}, order={self.order!r}, rank_offset={self.rank_offset})"


def hierarchical_groups(groups: IntArray, sizes: Sequence[int]) -> list[IntArray]:
    """``create_hierarchical_groups`` applied to every group of ``groups`` at once.

    Level ``i`` takes ``sizes[i]`` ranks with stride ``prod(sizes[:i])`` inside blocks of
    ``prod(sizes[:i + 1])``. Example: one group ``0..15`` with sizes ``[2, 2, 4]`` gives level 0
    ``[0, 1], [2, 3], ...``, level 1 ``[0, 2], [1, 3], ...``, level 2 ``[0, 4, 8, 12], ...``.
    """
    count, width = groups.shape
    if math.prod(sizes) != width:
        raise LayoutError(f"hierarchical sizes {list(sizes)} do not multiply to group size {width}")
    levels = []
    for level, size in enumerate(sizes):
        inner = math.prod(sizes[:level])
        outer = math.prod(sizes[level + 1 :])
        blocks = groups.reshape(count, outer, size, inner)
        levels.append(blocks.transpose(0, 1, 3, 2).reshape(-1, size))
    return levels


def hybrid_sizes(width: int) -> list[int]:
    """Group sizes ``create_hybrid_dp_cp_groups`` builds for a dp-cp group of ``width`` ranks:
    every power of two from 2 below ``width``, kept only where it divides ``width``.

    Upstream also chunks ``ranks[i:i + size]`` when ``size`` does not divide the group, which
    leaves a short last chunk; such ragged families are not one rank array and are left out.
    """
    return [2**i for i in range(1, int(math.log2(width))) if width % 2**i == 0] if width else []


def hybrid_dp_cp_groups(groups: IntArray, size: int) -> IntArray:
    """Consecutive chunks of ``size`` ranks of every dp-cp group (hybrid DP×CP)."""
    return groups.reshape(-1, size)
