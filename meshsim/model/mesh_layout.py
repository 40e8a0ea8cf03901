"""DeviceMesh's layout algebra in torch's own terms: sizes and strides, pure numpy.

Since torch 2.9, ``DeviceMesh`` keeps no rank tensor per view: each view holds a ``_MeshLayout``
(one ``_FlatLayout`` per dim, each a list of ``(size, stride)`` modes over the root's 1-D rank
map), and slicing, ``_flatten`` and ``_unflatten`` are CuTe-style algebra on it (coalesce,
composition, complement, splice). A bug report about a DeviceMesh is often phrased in those
terms (``(2, 2):(4, 1)``), so meshsim answers in them too: :meth:`meshsim.Layout.mesh_layout`
gives the layout torch would hold for any dim, slice or flattened dim, and
:meth:`meshsim.Layout.from_mesh_layout` turns a torch-style layout back into a Layout.

Conventions are torch's, not CuTe's: modes run outermost first (lexicographic, the last mode is
the fastest), and a :class:`FlatLayout` is always stored normalised (size-1 modes dropped,
adjacent modes merged when ``size * stride`` of the inner one equals the stride of the outer
one), so equal layouts compare equal. Where torch asserts (a composition that does not divide,
a complement of overlapping modes) the functions raise :class:`LayoutError` with
``upstream="AssertionError"``. Rank enumeration is vectorised: a 2^20-rank layout's global
ranks are one broadcast sum.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from meshsim.errors import LayoutError

Mode = tuple[int, int]
"""One ``(size, stride)`` pair."""

Ranks = npt.NDArray[np.int64]


def _as_ints(value: int | Sequence[object], what: str) -> tuple[int, ...]:
    """Flatten an int or a nested tuple of ints (torch's IntTuple) to a flat tuple."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (tuple, list)):
        return tuple(i for part in value for i in _as_ints(part, what))  # type: ignore[arg-type]
    raise LayoutError(
        f"{what} must be an int or a tuple of ints, got {value!r}", upstream="TypeError"
    )


def coalesce(modes: Iterable[Mode]) -> tuple[Mode, ...]:
    """Drop size-1 modes and merge each mode into its inner neighbour where they are contiguous.

    Walks from the fastest mode outwards: an outer mode ``(s, d)`` joins the inner ``(t, e)``
    when ``t * e == d``, giving ``(s * t, e)``. Example: ``(2, 4):(4, 1)`` becomes ``8:1``.
    """
    inner_first: list[Mode] = []
    for size, stride in reversed(list(modes)):
        if size == 1:
            continue
        if inner_first and inner_first[-1][0] * inner_first[-1][1] == stride:
            inner_size, inner_stride = inner_first[-1]
            inner_first[-1] = (inner_size * size, inner_stride)
        else:
            inner_first.append((size, stride))
    return tuple(reversed(inner_first))


def suffix_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides: each size's stride is the product of the sizes after it."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(sizes[i + 1])
    return tuple(strides)


@functools.lru_cache(maxsize=4)
def iota(size: int) -> Ranks:
    """``0..size-1``, one read-only int64 array per size, shared: an unflattened world's grid
    is a view of it, and comparing a grid with it allocates nothing (at 131,072 ranks, making
    it anew cost a megatron enumeration half its time)."""
    ranks = np.arange(size, dtype=np.int64)
    ranks.flags.writeable = False
    return ranks


def is_identity(grid: Ranks) -> bool:
    """``grid`` holds ``0..N-1`` in row-major order (every unflattened world)."""
    flat = grid.ravel()
    return bool(
        flat.size and flat[0] == 0 and flat[-1] == flat.size - 1
        and np.array_equal(flat, iota(flat.size))
    )  # fmt: skip


def _offsets(modes: Sequence[Mode]) -> Ranks:
    """Every index the modes reach, lexicographically (first mode slowest), as int64."""
    out = np.zeros(1, dtype=np.int64)
    for size, stride in modes:
        out = (out[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return out


@dataclass(frozen=True)
class FlatLayout:
    """torch's ``_FlatLayout``: the normalised (coalesced) modes of one mesh dim.

    ``FlatLayout((2, 2), (4, 1))`` is the dim you get by flattening ``dp`` and ``tp`` of a
    ``(dp=2, cp=2, tp=2)`` mesh: ranks ``0, 1, 4, 5`` from rank 0.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __init__(
        self, shape: int | Sequence[object] = (), stride: int | Sequence[object] | None = None
    ):
        sizes = _as_ints(shape, "shape")
        strides = suffix_strides(sizes) if stride is None else _as_ints(stride, "stride")
        if len(sizes) != len(strides):
            raise LayoutError(
                f"sizes {shape} and strides {stride} don't match", upstream="ValueError"
            )
        if any(s < 0 for s in sizes) or any(d < 0 for d in strides):
            # Size 0 is legal: torch's complement of overlapping modes makes one.
            raise LayoutError(f"sizes and strides must be >= 0, got {shape}:{stride}")
        modes = coalesce(zip(sizes, strides))
        object.__setattr__(self, "shape", tuple(s for s, _ in modes))
        object.__setattr__(self, "stride", tuple(d for _, d in modes))

    @property
    def modes(self) -> tuple[Mode, ...]:
        return tuple(zip(self.shape, self.stride))

    @property
    def sizes_and_strides(self) -> Iterator[Mode]:
        return iter(self.modes)

    def numel(self) -> int:
        return math.prod(self.shape)

    def cosize(self) -> int:
        """One past the largest index the layout reaches."""
        return sum((s - 1) * d for s, d in self.modes) + 1

    def composition(self, layout: MeshLayout) -> MeshLayout:
        """``self ∘ layout``: pick, through ``layout``'s indices, among the ranks ``self`` reaches.

        This is how ``_unflatten`` splits a dim: ``dim.composition(from_sizes_strides(sizes))``.
        Each axis of ``layout`` gives one axis of the result.
        """
        return MeshLayout(
            FlatLayout(*_unzip(m for mode in axis.modes for m in self._compose_mode(mode)))
            for axis in layout
        )

    def _compose_mode(self, mode: Mode) -> tuple[Mode, ...]:
        """Compose with one ``size:stride`` mode: skip ``stride`` indices, keep ``size`` of them.

        Walks this layout's modes from the fastest: each consumes as much of the wanted stride
        and size as it divides, the slowest mode takes what is left.
        """
        want_size, want_stride = mode
        if want_stride == 0:
            return ((want_size, 0),)
        own = self.modes or ((1, 0),)
        picked: list[Mode] = []  # fastest first
        for size, stride in reversed(own[1:]):
            if size % want_stride and want_stride % size:
                raise LayoutError(
                    f"cannot compose {self} with {mode[0]}:{mode[1]}: mode size {size} and stride "
                    f"{want_stride} do not divide each other",
                    upstream="AssertionError",
                )
            take = min(max(1, size // want_stride), want_size)
            if take != 1:
                picked.append((take, want_stride * stride))
            want_size //= take
            want_stride = -(-want_stride // size)
        if want_size != 1 or not picked:
            picked.append((want_size, want_stride * own[0][1]))
        return tuple(reversed(picked))

    def complement(self, world_size: int) -> FlatLayout:
        """The layout of offsets that tile ``self`` out to ``world_size`` indices.

        Example: ``FlatLayout(2, 2).complement(8)`` is ``(2, 2):(4, 1)``: groups of ``0, 2``
        start at ``0, 1, 4, 5``.
        """
        modes: list[Mode] = []  # fastest first
        covered = 1
        for stride, size in sorted((d, s) for s, d in self.modes):
            if stride == 0 or size == 1:
                continue
            if covered > size * stride:
                raise LayoutError(
                    f"cannot take the complement of {self}: its modes overlap",
                    upstream="AssertionError",
                )
            modes.append((stride // covered, covered))
            covered = size * stride
        modes.append((-(-int(world_size) // covered), covered))
        return FlatLayout(*_unzip(reversed(modes)))

    def ranks(self) -> Ranks:
        """Every index the layout reaches from 0, lexicographically (torch's coordinate order)."""
        return _offsets(self.modes)

    def all_ranks_from_zero(self) -> list[int]:
        """:meth:`ranks` as a list (torch's name)."""
        return self.ranks().tolist()

    def global_ranks(self, world_size: int) -> Ranks:
        """Every group of this dim in a world of ``world_size``: one row per complement offset.

        Torch returns the same rows as nested lists; here it is a ``(groups, numel)`` array.
        """
        return self.complement(world_size).ranks()[:, None] + self.ranks()[None, :]

    def check_sorted(self) -> bool:
        """Strides descend (torch requires it of a slice: dims in root order)."""
        return list(self.stride) == sorted(self.stride, reverse=True)

    def check_orthogonal(self) -> bool:
        """No two modes reach the same index (each stride clears the next mode's span)."""
        ordered = sorted(self.modes, key=lambda m: (m[1], m[0]), reverse=True)
        # A stride-0 mode repeats index 0 (torch divides by zero here; meshsim says "overlap").
        return all(
            inner[1] != 0 and outer[1] % (inner[0] * inner[1]) == 0
            for outer, inner in itertools.pairwise(ordered)
        )

    def __str__(self) -> str:
        return f"{self.shape}:{self.stride}"


@dataclass(frozen=True)
class MeshLayout(Sequence[FlatLayout]):
    """torch's ``_MeshLayout``: one :class:`FlatLayout` per mesh dim, outermost first."""

    axes: tuple[FlatLayout, ...]

    def __init__(self, axes: Iterable[FlatLayout] = ()) -> None:
        object.__setattr__(self, "axes", tuple(axes))

    @classmethod
    def from_sizes_strides(
        cls, sizes: Sequence[int], strides: Sequence[int] | None = None
    ) -> MeshLayout:
        """One single-mode dim per size; row-major strides unless given (``init_device_mesh``)."""
        sizes = tuple(int(s) for s in sizes)
        strides = suffix_strides(sizes) if strides is None else tuple(int(d) for d in strides)
        if len(sizes) != len(strides):
            raise LayoutError(
                f"sizes and strides must have the same length, got {len(sizes)} and {len(strides)}",
                upstream="ValueError",
            )
        return cls(FlatLayout((s,), (d,)) for s, d in zip(sizes, strides))

    def __len__(self) -> int:
        return len(self.axes)

    def __getitem__(self, i: int | slice) -> FlatLayout | MeshLayout:  # type: ignore[override]
        return MeshLayout(self.axes[i]) if isinstance(i, slice) else self.axes[i]

    def __iter__(self) -> Iterator[FlatLayout]:
        return iter(self.axes)

    @property
    def top_level_sizes(self) -> tuple[int, ...]:
        return tuple(axis.numel() for axis in self.axes)

    def numel(self) -> int:
        return math.prod(self.top_level_sizes)

    def cosize(self) -> int:
        return sum((s - 1) * d for axis in self.axes for s, d in axis.modes) + 1

    def collapse(self) -> FlatLayout:
        """All dims as one (what ``_flatten`` stores)."""
        return FlatLayout(*_unzip(m for axis in self.axes for m in axis.modes))

    def splice(self, start: int, end: int, layout: MeshLayout) -> MeshLayout:
        """``self[:start] + layout + self[end:]`` (``_unflatten`` puts the split dims in place)."""
        axes = list(self.axes)
        axes[start:end] = list(layout.axes)
        return MeshLayout(axes)

    def unflatten(self, dim: int, sizes: Sequence[int]) -> MeshLayout:
        """Split ``dim`` into ``sizes`` row-major, as ``DeviceMesh._unflatten`` does."""
        inner = MeshLayout.from_sizes_strides(sizes)
        if inner.numel() != self.axes[dim].numel():
            raise LayoutError(
                f"The product of {tuple(sizes)} is {inner.numel()}, but dim {dim} has size "
                f"{self.axes[dim].numel()}.",
                upstream="ValueError",
            )
        return self.splice(dim, dim + 1, self.axes[dim].composition(inner))

    def global_ranks(self, world_size: int) -> Ranks:
        """Every sub-mesh of this layout in the world, as ``(count, *top_level_sizes)``."""
        return self.remap_to_tensor(np.arange(world_size, dtype=np.int64))

    def remap_to_tensor(self, rank_map: npt.ArrayLike) -> Ranks:
        """Every sub-mesh of this layout, as ranks of ``rank_map`` (the root's rank list).

        Shape ``(count, *top_level_sizes)``: one row per offset of the complement, which is
        what ``DeviceMesh.mesh`` picks its own row from and what ``_init_one_process_group``
        turns into groups.
        """
        ranks = np.asarray(rank_map, dtype=np.int64)
        if ranks.ndim != 1:
            raise LayoutError("the rank map must be 1-D", upstream="AssertionError")
        if ranks.size < self.cosize():
            raise LayoutError(
                f"rank map of {ranks.size} ranks is too small for layout {self} (cosize "
                f"{self.cosize()})",
                upstream="AssertionError",
            )
        flat = self.collapse()
        index = flat.complement(ranks.size).ranks()[:, None] + flat.ranks()[None, :]
        if index.size and int(index.max()) >= ranks.size:
            raise LayoutError(
                f"layout {self} does not tile a world of {ranks.size} ranks",
                upstream="RuntimeError",
            )
        return ranks[index].reshape(-1, *self.top_level_sizes)

    def __str__(self) -> str:
        return "(" + ", ".join(str(a) for a in self.axes) + ")"


def _unzip(modes: Iterable[Mode]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pairs = list(modes)
    return tuple(s for s, _ in pairs), tuple(d for _, d in pairs)


# -- the bridge to meshsim.Layout ---------------------------------------------------------------
# It speaks in grids and root axes, not Layouts: ``layout.py`` imports this module, never back.


def root_modes(grid: Ranks) -> tuple[tuple[tuple[Mode, ...], ...], Ranks]:
    """Each root axis's ``(size, stride)`` modes and the rank map those strides index.

    A grid that is a strided view of ``0..N-1`` (every ``init_device_mesh`` root and every
    ``_flatten``/``_unflatten`` chain from one) gets its modes in rank space over the identity
    rank map, exactly torch's; a root axis made by unflattening a non-contiguous flatten keeps
    several modes (``(2, 2):(4, 1)``), as torch's composed ``_layout`` does. Any other grid (an
    explicit ``mesh=`` tensor) is indexed by position, its row-major ravel being the rank map,
    as ``DeviceMesh(mesh=...)`` stores it. ``grid`` is a Layout's root grid (``Layout.mesh``).
    """
    modes, rank_map, _ = _root_facts(grid)
    return modes, rank_map


def strided_root_modes(grid: Ranks) -> tuple[tuple[Mode, ...], ...] | None:
    """:func:`root_modes`' modes where ``grid`` is a strided view of ``0..N-1`` (they then
    decide every group family of the grid, row for row); None for any other grid."""
    modes, _, strided = _root_facts(grid)
    return modes if strided else None


def _root_facts(grid: Ranks) -> tuple[tuple[tuple[Mode, ...], ...], Ranks, bool]:
    cached = _ROOT_MODES.get(id(grid))
    if cached is not None and cached[0]() is grid:
        return cached[1], cached[2], cached[3]
    modes, rank_map, strided = _derive_root_modes(grid)
    rank_map.flags.writeable = False
    if len(_ROOT_MODES) >= 64:
        _ROOT_MODES.clear()
    _ROOT_MODES[id(grid)] = (weakref.ref(grid), modes, rank_map, strided)
    return modes, rank_map, strided


#: id(grid) -> (weak ref to the grid, modes, rank map, strided). Grids are read-only and shared
#: by every view of a root, so the O(world) strided-ness check runs once per root, not once per
#: query.
_ROOT_MODES: dict[int, tuple[weakref.ref[Any], tuple[tuple[Mode, ...], ...], Ranks, bool]] = {}


def _derive_root_modes(grid: Ranks) -> tuple[tuple[tuple[Mode, ...], ...], Ranks, bool]:
    shape = tuple(int(s) for s in grid.shape)
    if is_identity(grid):
        # 0..N-1 in row-major order (every unflattened world): one mode per axis, its
        # row-major stride; the general walk below finds the same, axis by axis.
        single = tuple(
            ((s, d),) if s > 1 else ((1, 0),) for s, d in zip(shape, suffix_strides(shape))
        )
        return single, iota(grid.size), True
    axes = []
    for i in range(grid.ndim):
        line = grid[tuple(slice(None) if j == i else 0 for j in range(grid.ndim))]
        axes.append(_axis_modes(line - line[0]))
    modes = tuple(axes)
    if (
        int(grid.flat[0]) == 0
        and int(grid.max()) == grid.size - 1
        and np.array_equal(grid.ravel(), _offsets([m for axis in modes for m in axis]))
    ):
        return modes, iota(grid.size), True
    modes = tuple(((s, d),) for s, d in zip(shape, suffix_strides(shape)))
    return modes, grid.ravel().copy(), False


def _axis_modes(line: Ranks) -> tuple[Mode, ...]:
    """The modes (outermost first) that reach ``line``'s offsets, if any do; the caller checks.

    Greedy from the fastest: each mode's stride is the offset one block in, its size the most
    steps that keep to that stride and still divide the axis. Non-strided lines give modes whose
    offsets differ from the line, which the caller's whole-grid comparison rejects.
    """
    n = len(line)
    if n == 1:
        return ((1, 0),)
    found: list[Mode] = []
    block = 1
    while block < n:
        stride = int(line[block])
        rest = n // block
        size = next(
            b
            for b in range(rest, 0, -1)
            if rest % b == 0
            and np.array_equal(line[: block * b : block], np.arange(b, dtype=np.int64) * stride)
        )
        if size == 1:  # no progress: not strided
            return ((n, stride),)
        found.append((size, stride))
        block *= size
    return tuple(reversed(found))


def mesh_layout_of(grid: Ranks, spans: Iterable[Sequence[int]]) -> MeshLayout:
    """torch's ``_layout`` of a mesh over the root ``grid``: one dim per entry of ``spans``, the
    root axes that dim spans (one for a plain dim, several for a flattened one)."""
    modes, _ = root_modes(grid)
    return MeshLayout(FlatLayout(*_unzip(m for a in span for m in modes[a])) for span in spans)


def grid_from_mesh_layout(
    mesh_layout: MeshLayout,
    names: Sequence[str],
    rank_map: npt.ArrayLike | None = None,
    *,
    rest: str = "rest",
) -> tuple[Ranks, tuple[str, ...]]:
    """The root grid and root axis names of the Layout whose dims ``names`` are
    ``mesh_layout`` over ``rank_map`` (``Layout.from_mesh_layout`` builds it).

    ``rank_map`` defaults to ``0..span-1``, the smallest world the layout tiles. When the
    layout does not cover the whole rank map, the complement becomes one extra root axis named
    ``rest`` (outermost), which the Layout's view leaves out.
    """
    names = tuple(names)
    if len(names) != len(mesh_layout):
        raise LayoutError(
            f"{len(names)} names for a {len(mesh_layout)}-D layout {mesh_layout}",
            upstream="RuntimeError",
        )
    if not mesh_layout.collapse().check_orthogonal():
        raise LayoutError(f"layout {mesh_layout} overlaps itself", upstream="AssertionError")
    # By default the smallest world the layout tiles: its widest mode's span.
    span = max((s * d for s, d in mesh_layout.collapse().modes), default=1)
    ranks = np.arange(span) if rank_map is None else np.asarray(rank_map)
    grid = mesh_layout.remap_to_tensor(ranks)
    if grid.shape[0] == 1:
        return grid[0], names
    if rest in names:
        raise LayoutError(f"the complement axis name {rest!r} is one of the dim names {names}")
    return grid, (rest, *names)
