"""Layout: a named-axis rank grid with DeviceMesh's slicing, flattening and unflattening rules.

A Layout is a value. It holds the root grid (every rank of the world, one array axis per root
axis), the dims this view exposes (root axes, or flattened aliases of several root axes), and the
alias table of its root. ``flatten`` therefore returns a *new* Layout whose root knows the alias;
``layout.root()`` gives that root back, the way ``DeviceMesh._get_root_mesh()`` does.

Every query is numpy index arithmetic over the grid: all groups of a dim are one transpose and one
reshape, and per-rank queries cost O(ndim).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from meshsim.errors import LayoutError
from meshsim.model import mesh_layout as _ml
from meshsim.model import torch_release
from meshsim.model.groups import FAMILIES, Group, Groups, RankGroup

AxisSpec = tuple[str, int]

#: Largest world the reference represents: it holds every rank of the world in numpy arrays
#: (8 bytes a rank, per group family), so 2**22 ranks already cost 32 MiB a family. A larger
#: world is refused with a LayoutError naming this limit, never a numpy allocation failure.
MAX_WORLD_SIZE = 1 << 22


class Layout:
    """Ranks laid out row-major over named axes, outermost first (last axis fastest).

    Example: ``Layout(dp=2, tp=4)`` puts tp groups at ``(0, 1, 2, 3)``, ``(4, 5, 6, 7)`` and dp
    groups at ``(0, 4)``, ``(1, 5)``, ``(2, 6)``, ``(3, 7)``, as ``init_device_mesh((2, 4),
    mesh_dim_names=("dp", "tp"))`` does.
    """

    __slots__ = (
        "_aliases",
        "_dims",
        "_families",
        "_grid",
        "_identity",
        "_named",
        "_names",
        "_position",
        "_shape",
        "_whole",
    )

    def __init__(self, axes: Iterable[AxisSpec] | Mapping[str, int] = (), /, **sizes: int) -> None:
        pairs = _axis_pairs(axes) + list(sizes.items())
        if not pairs:
            raise LayoutError("a Layout needs at least one axis, e.g. Layout(dp=4)")
        names = [_check_name(name) for name, _ in pairs]
        shape = [_check_size(name, size) for name, size in pairs]
        _check_unique(names)
        check_world_size(math.prod(shape), f"a Layout of shape {tuple(shape)}")
        grid = _ml.iota(math.prod(shape)).reshape(shape)
        self._init(grid, tuple(names), tuple(names), {}, named=True)

    # -- construction ---------------------------------------------------------------------
    def _init(
        self,
        grid: npt.NDArray[np.int64],
        names: tuple[str, ...],
        dims: tuple[str, ...],
        aliases: Mapping[str, tuple[int, ...]],
        *,
        named: bool = True,
    ) -> None:
        grid.flags.writeable = False
        self._grid = grid
        self._names = names
        self._dims = dims
        self._aliases = dict(aliases)
        self._named = named
        self._position: npt.NDArray[np.int64] | None = None
        self._identity: bool | None = None
        self._shape: tuple[int, ...] | None = None
        #: The groups spanning each set of root axes, asked of any view of this grid: a
        #: framework's getters hand out the same few views many times over.
        self._families: dict[tuple[int, ...], Groups] = {}
        self._whole: Groups | None = None  # groups() of this view's own dims

    @classmethod
    def _make(cls, *state: Any, **options: Any) -> Layout:
        """A Layout from :meth:`_init`'s arguments, past ``__init__``'s axis parsing."""
        layout = cls.__new__(cls)
        layout._init(*state, **options)
        return layout

    def _view(self, dims: tuple[str, ...], aliases: Mapping[str, tuple[int, ...]]) -> Layout:
        """Another view of this grid: what was learnt of the grid comes along."""
        view = Layout._make(self._grid, self._names, dims, aliases, named=self._named)
        view._identity, view._position = self._identity, self._position
        view._families = self._families
        return view

    @classmethod
    def from_order(cls, order: str, **sizes: int) -> Layout:
        """Megatron order string, fastest axis first: ``"tp-dp-pp"`` is the row-major (pp, dp, tp).

        Axes missing from ``order`` are appended as the slowest when their size is 1; a missing
        axis of size > 1 is an error, as in megatron-core's ``RankGenerator``.

        Example: ``Layout.from_order("tp-dp-pp", tp=2, dp=3, pp=4)`` has dp groups
        ``(0, 2, 4)``, ``(1, 3, 5)``, ... ``(19, 21, 23)``.
        """
        if not isinstance(order, str):
            raise LayoutError(f"order must be a string such as 'tp-dp-pp', got {order!r}")
        items = tuple(sizes.items())
        try:
            hash(items)
            kept = math.prod(sizes.values()) <= KEPT_ORDER_WORLD
        except TypeError:  # a size that is no int: refused below, with its name
            kept = False
        return _from_order(order, items) if kept else _from_order.__wrapped__(order, items)

    @classmethod
    def from_topology(cls, axes: Sequence[str], dims: Sequence[int]) -> Layout:
        """DeepSpeed ``ProcessTopology(axes, dims)``: row-major, last axis fastest."""
        axes, dims = _sequence(axes, "axes"), _sequence(dims, "dims")
        if len(axes) != len(dims):
            raise LayoutError(f"axes {list(axes)} and dims {list(dims)} differ in length")
        return cls(list(zip(axes, dims)))

    @classmethod
    def from_mesh(cls, mesh: npt.ArrayLike, names: Sequence[str] | None = None) -> Layout:
        """An explicit rank tensor, as ``DeviceMesh("cpu", mesh=[[0, 2], [1, 3]])`` takes.

        ``names=None`` gives an unnamed layout: it answers queries by dim index but cannot be
        sliced or flattened (torch's rule for meshes without ``mesh_dim_names``).
        """
        grid = _rank_tensor(mesh)
        if grid.ndim == 0 or grid.size == 0:
            raise LayoutError(f"mesh must be a non-empty rank tensor, got {mesh!r}")
        if (grid < 0).any():
            raise LayoutError(f"mesh holds negative ranks: {sorted(set(grid[grid < 0].tolist()))}")
        if np.unique(grid).size != grid.size:
            values, counts = np.unique(grid, return_counts=True)
            raise LayoutError(f"mesh repeats ranks {values[counts > 1].tolist()}")
        if names is None:
            auto = tuple(f"dim{i}" for i in range(grid.ndim))
            return cls._make(grid, auto, auto, {}, named=False)
        names = tuple(_check_name(n) for n in _sequence(names, "names"))
        if len(names) != grid.ndim:
            raise LayoutError(
                f"mesh_shape and mesh_dim_names should have same length! Found {grid.ndim} "
                f"and {len(names)}.",
                upstream="RuntimeError",
            )
        _check_unique(names)
        return cls._make(grid, names, names, {}, named=True)

    # -- what this view is ----------------------------------------------------------------
    @property
    def dim_names(self) -> tuple[str, ...]:
        """The dims this view exposes, in order (root axes or flattened aliases)."""
        return self._dims

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            self._shape = tuple(self._dim_size(d) for d in self._dims)
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._dims)

    @property
    def size(self) -> int:
        """Ranks in one sub-mesh of this view (the product of ``shape``)."""
        return math.prod(self.shape)

    @property
    def world_size(self) -> int:
        """Ranks covered by the root grid."""
        return int(self._grid.size)

    @property
    def root_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def root_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._grid.shape)

    @property
    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Flattened names registered on the root, each with the root axes it spans."""
        return {a: tuple(self._names[i] for i in axes) for a, axes in self._aliases.items()}

    @property
    def mesh(self) -> npt.NDArray[np.int64]:
        """The root grid (read-only): ``mesh[c0, c1, ...]`` is the rank at that coordinate."""
        return self._grid

    @property
    def is_root(self) -> bool:
        return self._dims == self._names

    def root(self) -> Layout:
        """The root view: every root axis, with every registered alias."""
        return self._view(self._names, self._aliases)

    def ranks(self) -> npt.NDArray[np.int64]:
        """All ranks of the grid, ascending."""
        return np.sort(self._grid, axis=None)

    # -- name resolution ------------------------------------------------------------------
    def _axes_of(self, dim: str | int) -> tuple[int, ...]:
        """Root axis indices a dim spans (several for a flattened alias)."""
        if dim.__class__ is str:  # the common case, first
            if dim in self._names:
                return (self._names.index(dim),)
            if dim in self._aliases:
                return self._aliases[dim]
        elif isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
            if not -self.ndim <= dim < self.ndim:
                raise LayoutError(
                    f"dim index {dim} is out of range for a {self.ndim}-D layout {self.dim_names}"
                )
            dim = self._dims[dim]
        if dim in self._names:
            return (self._names.index(dim),)
        if dim in self._aliases:
            return self._aliases[dim]
        valid = list(self._dims) + [a for a in self._aliases if a not in self._dims]
        raise LayoutError(
            f"Mesh dimension {dim!r} does not exist; valid dims: {valid}", upstream="KeyError"
        )

    def _dim_size(self, dim: str | int) -> int:
        axes, shape = self._axes_of(dim), self._grid.shape
        return shape[axes[0]] if len(axes) == 1 else math.prod(shape[a] for a in axes)

    def _resolve(self, dims: Sequence[str | int]) -> tuple[int, ...]:
        """Root axes spanned by ``dims`` (all visible dims when empty), in root order."""
        if not dims:
            dims = self._dims
        axes: list[int] = []
        for d in dims:
            for a in self._axes_of(d):
                if a in axes:
                    raise LayoutError(f"dims {tuple(dims)} overlap on root axis {self._names[a]!r}")
                axes.append(a)
        return tuple(sorted(axes))

    def size_of(self, dim: str | int) -> int:
        """Size of one dim (a flattened alias has the product of its axes)."""
        return self._dim_size(dim)

    # -- per-rank queries, O(ndim) --------------------------------------------------------
    def _root_coordinate(self, rank: int) -> tuple[int, ...]:
        rank = _check_index(rank, "rank")
        if self._identity is None:
            self._identity = _ml.is_identity(self._grid)
            if not self._identity:
                position = np.full(int(self._grid.max()) + 1, -1, dtype=np.int64)
                position[self._grid.ravel()] = np.arange(self._grid.size, dtype=np.int64)
                self._position = position
        if self._position is None:
            flat = rank if 0 <= rank < self._grid.size else -1
        else:
            flat = int(self._position[rank]) if 0 <= rank < self._position.size else -1
        if flat < 0:
            raise LayoutError(f"rank {rank} is not in this layout (world size {self.world_size})")
        return tuple(int(c) for c in np.unravel_index(flat, self._grid.shape))

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every dim of this view (an alias gets its flattened index)."""
        root = self._root_coordinate(rank)
        out = {}
        for dim in self._dims:
            axes = self._axes_of(dim)
            out[dim] = _ravel([root[a] for a in axes], [self._grid.shape[a] for a in axes])
        return out

    def rank(self, **coordinate: int) -> int:
        """The rank at a full coordinate (root axes, or aliases standing for them)."""
        root: dict[int, int] = {}
        for name, value in coordinate.items():
            value = _check_index(value, f"coordinate {name}")
            axes = self._axes_of(name)
            sizes = [int(self._grid.shape[a]) for a in axes]
            if not 0 <= value < math.prod(sizes):
                raise LayoutError(
                    f"coordinate {name}={value} is out of range 0..{math.prod(sizes) - 1}"
                )
            for a, c in zip(axes, np.unravel_index(value, sizes)):
                if a in root:
                    raise LayoutError(f"coordinate names root axis {self._names[a]!r} twice")
                root[a] = int(c)
        missing = [self._names[a] for a in range(self._grid.ndim) if a not in root]
        if missing:
            raise LayoutError(
                f"rank() needs every axis; missing {missing}. Use filter() for partial coordinates."
            )
        return int(self._grid[tuple(root[a] for a in range(self._grid.ndim))])

    def group_of(self, rank: int, *dims: str | int) -> Group:
        """The group spanning ``dims`` (all of this view's dims when none) that holds ``rank``."""
        axes = self._resolve(dims)
        root = self._root_coordinate(rank)
        index = tuple(slice(None) if a in axes else root[a] for a in range(self._grid.ndim))
        return RankGroup(self._grid[index].ravel().tolist())

    def local_rank(self, rank: int, *dims: str | int) -> int:
        """``rank``'s index inside its group spanning ``dims``."""
        axes = self._resolve(dims)
        root = self._root_coordinate(rank)
        return _ravel([root[a] for a in axes], [self._grid.shape[a] for a in axes])

    def mesh_of(self, rank: int) -> npt.NDArray[np.int64]:
        """The sub-mesh tensor ``rank`` sees for this view (``DeviceMesh.mesh`` on that rank)."""
        group = np.asarray(self.group_of(rank), dtype=np.int64)
        return group.reshape(self.shape)

    def filter(self, **partial: int) -> tuple[int, ...]:
        """Ranks whose coordinate matches every given axis, in grid order (DeepSpeed's
        ``filter_match``). Example: ``Layout(pipe=2, data=2, model=2).filter(pipe=0, data=1)``
        is ``(2, 3)``."""
        index: list[Any] = [slice(None)] * self._grid.ndim
        for name, value in partial.items():
            value = _check_index(value, f"filter {name}")
            axes = self._axes_of(name)
            if len(axes) != 1:
                raise LayoutError(f"filter() takes root axes; {name!r} is flattened from {axes}")
            if not 0 <= value < self._grid.shape[axes[0]]:
                return ()
            index[axes[0]] = value
        return RankGroup(self._grid[tuple(index)].ravel().tolist())

    # -- whole families, vectorised -------------------------------------------------------
    def groups_array(self, *dims: str | int) -> npt.NDArray[np.int64]:
        """All groups spanning ``dims`` as a ``(num_groups, group_size)`` array.

        One group per combination of the other root axes, enumerated row-major; inside a group,
        ranks run row-major over the spanned axes in root order (so ``groups("cp", "dp")`` equals
        ``groups("dp", "cp")``, as in Megatron).
        """
        axes = self._resolve(dims)
        others = tuple(a for a in range(self._grid.ndim) if a not in axes)
        size = math.prod(int(self._grid.shape[a]) for a in axes)
        return self._grid.transpose(others + axes).reshape(-1, size)

    def groups(self, *dims: str | int) -> Groups:
        """All groups spanning ``dims`` (all of this view's dims when none), as :class:`Groups`.

        Where the grid is strided (``rank = first + sum(coordinate * stride)``: every grid a
        framework convention builds), one object stands for each family, shared by every
        layout that spans it: a sweep's tens of thousands of layouts share a few hundred
        families, whose answers (``Groups.derived``) are then worked out once.
        """
        if not dims and self._whole is not None:
            return self._whole
        axes = self._resolve(dims)
        found = self._families.get(axes)
        if found is None:
            key = self._family_key(axes) if FAMILIES.keeps(self._grid.nbytes) else None
            if key is None:  # not strided, or too big to keep
                return FAMILIES.share(Groups.from_array(self.groups_array(*dims)))
            found = FAMILIES.get(key, lambda: Groups.from_array(self.groups_array(*dims)))
            self._families[axes] = found
        if not dims:
            self._whole = found
        return found

    def _family_key(self, axes: tuple[int, ...]) -> tuple[Any, ...] | None:
        """What decides the groups spanning root ``axes`` row for row on a strided grid: the
        coalesced modes of the spanned axes and of the others, each in root order. None on a
        grid that is not strided."""
        modes = _ml.strided_root_modes(self._grid)
        if modes is None:
            return None
        others = (a for a in range(len(modes)) if a not in axes)
        return (
            _ml.coalesce(m for a in axes for m in modes[a]),
            _ml.coalesce(m for a in others for m in modes[a]),
        )

    # -- DeviceMesh transformations -------------------------------------------------------
    def _require_names(self, verb: str) -> None:
        if not self._named:
            raise LayoutError(
                f"Cannot {verb} a DeviceMesh without mesh_dim_names!", upstream="RuntimeError"
            )

    def __getitem__(self, dims: str | Sequence[str]) -> Layout:
        """Slice named dims, torch's way: names in root order, no overlap.

        ``layout["cp", "dp"]`` on a ``(dp, cp, tp)`` layout raises, as torch does, because the
        sliced dims must keep the root's (descending-stride) order.
        """
        self._require_names("slice")
        names = (dims,) if isinstance(dims, str) else _sequence(dims, "a slice of a Layout")
        if names == self._dims:
            return self
        # What torch says of a slice depends on names and on which axes have size 1 (every
        # size, under 2.10-2.12's stride rule), not on the ranks: a sweep's thousands of
        # layouts ask the same few hundred questions.
        rule = torch_release.slice_order_rule()
        shape = self._grid.shape
        key = (
            self._names, self._dims, tuple(self._aliases.items()), names, rule,
            shape if rule == "strides" else tuple(size == 1 for size in shape),
        )  # fmt: skip
        refusal = _SLICE_VERDICTS.get(key, _UNASKED)
        if refusal is _UNASKED:
            refusal = self._slice_refusal(names)
            if len(_SLICE_VERDICTS) >= _KEPT_VERDICTS:
                _SLICE_VERDICTS.clear()
            _SLICE_VERDICTS[key] = refusal
        if refusal is not None:
            raise LayoutError(refusal[0], upstream=refusal[1])
        return self._view(names, self._aliases)

    def _slice_refusal(self, names: tuple[str, ...]) -> tuple[str, str | None] | None:
        """Why torch refuses to slice ``names`` (message, exception type); None if it
        does not."""
        try:
            self._check_slice(names)
        except LayoutError as error:
            return str(error), error.upstream
        return None

    def _check_slice(self, names: tuple[str, ...]) -> None:
        allowed = set(self._dims) | (set(self._aliases) if self.is_root else set())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise LayoutError(
                f"Invalid mesh_dim_names {names} specified. Valid mesh_dim_names are "
                f"{tuple(sorted(allowed, key=self._sort_key))}.",
                upstream="KeyError",
            )
        spans = [self._axes_of(n) for n in names]
        flat = [a for span in spans for a in span]
        if len(set(flat)) != len(flat):
            raise LayoutError(
                f"Slicing overlapping dim_names {names} is not allowed.", upstream="RuntimeError"
            )
        if (len(spans) > 1 or len(spans[0]) > 1) and not self._slice_in_order(spans):
            wanted = tuple(sorted(names, key=lambda n: min(self._axes_of(n))))
            raise LayoutError(
                f"Invalid mesh_dim_names {names} specified. Mesh dim indices should be in "
                f"ascending order; use {wanted}.",
                upstream="KeyError",
            )

    def _slice_in_order(self, spans: Sequence[tuple[int, ...]]) -> bool:
        """Whether torch (the release described) takes the sliced dims in this order (one
        root axis alone always is, on every release)."""
        rule = torch_release.slice_order_rule()
        if rule == "collapsed":  # torch >= 2.13 compares collapsed layouts: size-1 modes vanish
            effective = [a for span in spans for a in span if self._grid.shape[a] != 1]
            return effective == sorted(effective)
        if rule == "indices":  # torch < 2.10: root dim indices (a flattened dim's last) ascend
            last = [span[-1] for span in spans]
            return all(a < b for a, b in itertools.pairwise(last))
        # torch 2.10-2.12: each dim's own stride, size-1 dims included, must not increase
        strides = _ml.suffix_strides(self._grid.shape)
        order = []
        for span in spans:
            modes = [(int(self._grid.shape[a]), strides[a]) for a in span]
            merged = _ml.coalesce(modes) if len(span) > 1 else modes
            if len(merged) > 1:
                raise LayoutError(
                    "Currently, this only allows slicing out a contiguous flattened dim.",
                    upstream="NotImplementedError",
                )
            order.append(merged[0][1] if merged else 0)
        return all(a >= b for a, b in itertools.pairwise(order))

    def _sort_key(self, name: str) -> tuple[int, str]:
        return (min(self._axes_of(name)), name)

    def flatten(self, *dims: str, name: str | None = None) -> Layout:
        """Flatten ``dims`` (all of this view's when none) into one dim registered on the root.

        Returns the 1-D view of the flattened dim; ``.root()`` of it sees the new alias. The
        default name joins the dim names with ``_`` (``dp_cp``). Flattening the same dims under
        the same name again returns the cached result; reusing a name for other dims, or a root
        axis name, raises as torch does.
        """
        self._require_names("flatten")
        if len(dims) == 1 and dims[0] not in self._dims and dims[0] not in self._aliases:
            raise LayoutError(
                f"flatten() takes the dims to flatten, and {dims[0]!r} is not one of "
                f"{self._dims}; to name the result write flatten(name={dims[0]!r})"
            )
        view = self[dims] if dims else self
        name = _check_name(name) if name is not None else "_".join(view._dims)
        if view.ndim == 1 and name == view._dims[0]:
            return view
        axes = view._resolve(())
        if name in self._names:
            raise LayoutError(
                f"{name} already exists for submesh of the {self.root()!r}. The mesh_dim_name "
                f"should be different from existing root dim names {self._names}.",
                upstream=torch_release.flatten_name_taken_error(),
            )
        if name in self._aliases and self._aliases[name] != axes:
            raise LayoutError(
                f"Flatten mesh with mesh_dim_name {name} has been created before with dims "
                f"{self.aliases[name]}; cannot reuse it for {tuple(self._names[a] for a in axes)}.",
                upstream="ValueError",
            )
        aliases = {**self._aliases, name: axes}
        return self._view((name,), aliases)

    def unflatten(self, dim: str | int, sizes: Sequence[int], names: Sequence[str]) -> Layout:
        """Split one dim into several, row-major (the first new name gets the largest stride).

        Returns a new layout; the new names are not registered on the old root. Example:
        ``Layout(world=8).unflatten("world", (2, 4), ("dp", "tp"))`` equals ``Layout(dp=2, tp=4)``.
        """
        self._require_names("unflatten")
        sizes = _sequence(sizes, "sizes")
        names = tuple(_check_name(n) for n in _sequence(names, "names"))
        if len(sizes) != len(names):
            raise LayoutError(
                "mesh_dim_names must have same length as mesh_sizes in _unflatten!",
                upstream="RuntimeError",
            )
        if isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
            if not 0 <= dim < self.ndim:
                raise LayoutError(
                    f"dim {dim} specified in `_unflatten` is out of range {self.ndim}",
                    upstream="ValueError",
                )
            dim = self._dims[dim]
        if dim not in self._dims:
            raise LayoutError(
                f"dim {dim!r} specified in `_unflatten` is not in {self._dims}",
                upstream="ValueError",
            )
        for n, s in zip(names, sizes):
            _check_size(n, s)
        if math.prod(sizes) != self._dim_size(dim):
            raise LayoutError(
                f"The product of {sizes=} is {math.prod(sizes)}, but the size of dim {dim!r} is "
                f"{self._dim_size(dim)}.",
                upstream="ValueError",
            )
        # torch splits by layout composition, which asserts on a split across non-adjacent axes.
        _unflatten_check(self.mesh_layout(dim), tuple(sizes))
        kept = [d for d in self._dims if d != dim]
        _check_unique(kept + list(names))
        clash = [
            n for n in names if n in self._names and n != dim and n not in self._axes_names(dim)
        ]
        if clash:
            raise LayoutError(f"Each mesh_dim_name must be unique; {clash} already name root axes")

        split = self._axes_of(dim)
        first = split[0]
        # Bring the split axes together (in root order) where the first one stands, then reshape.
        order = [a for a in range(self._grid.ndim) if a not in split or a == first]
        at = order.index(first)
        order[at : at + 1] = list(split)
        grid = self._grid.transpose(order)
        shape = [int(s) for s in grid.shape]
        new_shape = shape[:at] + list(sizes) + shape[at + len(split) :]
        grid = np.ascontiguousarray(grid.reshape(new_shape))
        old_names = [self._names[a] for a in order]
        root_names = tuple(old_names[:at] + list(names) + old_names[at + len(split) :])
        _check_unique(root_names)

        new_index = {old: i for i, old in enumerate(order) if old not in split}
        new_index = {
            old: (i if i < at else i + len(sizes) - len(split)) for old, i in new_index.items()
        }
        aliases = {
            a: tuple(sorted(new_index[x] for x in axes))
            for a, axes in self._aliases.items()
            if not set(axes) & set(split) and a not in names
        }
        dims = tuple(n for d in self._dims for n in (names if d == dim else (d,)))
        return Layout._make(grid, root_names, dims, aliases)

    def _axes_names(self, dim: str) -> tuple[str, ...]:
        return tuple(self._names[a] for a in self._axes_of(dim))

    # -- torch's own terms: sizes and strides (meshsim.model.mesh_layout) -----------------
    def mesh_layout(self, *dims: str | int) -> _ml.MeshLayout:
        """torch's ``DeviceMesh._layout`` for ``dims`` (all when none; an alias is one collapsed
        dim), striding :meth:`rank_map`: ``Layout(dp=2, tp=4).mesh_layout("dp")`` is ``(2,):(4,)``.
        """
        return _ml.mesh_layout_of(self._grid, [self._axes_of(d) for d in dims or self._dims])

    def rank_map(self) -> npt.NDArray[np.int64]:
        """The 1-D rank list :meth:`mesh_layout` strides over (``DeviceMesh._rank_map``)."""
        return _ml.root_modes(self._grid)[1]

    @classmethod
    def from_mesh_layout(
        cls, layout: _ml.MeshLayout, names: Sequence[str], rank_map: npt.ArrayLike | None = None
    ) -> Layout:
        """The Layout of a torch-style ``_MeshLayout`` over ``rank_map`` (default ``0..N-1``)."""
        grid, root_names = _ml.grid_from_mesh_layout(layout, names, rank_map)
        root = Layout.from_mesh(grid, root_names)
        # A complement axis (``rest``) stays in the root, out of the view.
        return root if root_names == tuple(names) else root[tuple(names)]

    # -- value semantics ------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self._names == other._names
            and self._dims == other._dims
            and np.array_equal(self._grid, other._grid)
        )

    def __hash__(self) -> int:
        return hash((self._names, self._dims, self._grid.shape))

    def __repr__(self) -> str:
        if _ml.is_identity(self._grid):
            body = ", ".join(f"{n}={s}" for n, s in zip(self._names, self._grid.shape))
        else:
            body = f"mesh={self._grid.tolist()}, names={self._names}"
        text = f"Layout({body})"
        if not self.is_root:
            text += f"[{', '.join(map(repr, self._dims))}]"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (self._grid.tolist(), self._names, self._dims, self._aliases, self._named),
        )


def known_slice(layout: Layout, dims: tuple[str, ...]) -> Layout:
    """``layout[dims]`` without torch's checks, for ``dims`` already sliced from a layout of
    the same names, aliases and size-1 axes (``_torchtitan_plan`` replays a pattern's
    slices on each layout of it)."""
    return layout if dims == layout._dims else layout._view(dims, layout._aliases)


def _rebuild(
    grid: list[Any],
    names: tuple[str, ...],
    dims: tuple[str, ...],
    aliases: dict[str, tuple[int, ...]],
    named: bool,
) -> Layout:
    return Layout._make(np.array(grid, dtype=np.int64), names, dims, aliases, named=named)


def check_world_size(size: int, what: str = "") -> None:
    """Refuse a world the reference cannot hold (:data:`MAX_WORLD_SIZE`), naming the limit."""
    if size > MAX_WORLD_SIZE:
        where = f" ({what})" if what else ""
        raise LayoutError(
            f"world size {size}{where} is over the reference's limit of {MAX_WORLD_SIZE} ranks "
            "(2**22): meshsim holds every rank of the world in memory"
        )


@functools.lru_cache(maxsize=4096)
def _unflatten_check(dim: _ml.MeshLayout, sizes: tuple[int, ...]) -> None:
    """Raise what torch's ``_unflatten`` of ``dim`` into ``sizes`` raises (its layout
    composition), once per question: a sweep unflattens the same worlds again and again."""
    dim.unflatten(0, sizes)


#: Slice verdicts kept by :meth:`Layout.__getitem__` (a few MiB), forgotten all at once.
_KEPT_VERDICTS = 65536
_SLICE_VERDICTS: dict[tuple[Any, ...], Any] = {}
_UNASKED = object()

#: The largest world whose ``from_order`` grids are kept (4,096 of them: 128 MiB at most).
KEPT_ORDER_WORLD = 4096


@functools.lru_cache(maxsize=4096)
def _from_order(order: str, items: tuple[tuple[str, int], ...]) -> Layout:
    """``Layout.from_order``, kept: a Layout is a value, and megatron's sweeps build the same
    grid for many configs (the dense and expert generators of every candidate)."""
    sizes = dict(items)
    tokens = [t for t in order.split("-") if t] if order else []
    _check_unique(tokens, what="order tokens")
    unknown = [t for t in tokens if t not in sizes]
    if unknown:
        raise LayoutError(
            f"order {order!r} names {unknown} but no size was given for "
            f"{'it' if len(unknown) == 1 else 'them'}; sizes given: {sorted(sizes)}"
        )
    for name, size in sizes.items():
        if name not in tokens:
            if _check_size(name, size) != 1:
                raise LayoutError(
                    f"The size of ({name}) is ({size}), but you haven't specified the order "
                    f"({order!r}).",
                    upstream="RuntimeError",
                )
            tokens.append(name)
    return Layout([(t, sizes[t]) for t in reversed(tokens)])


def _axis_pairs(axes: object) -> list[tuple[Any, Any]]:
    """``Layout``'s positional axes (pairs or a mapping) as (name, size) pairs."""
    if isinstance(axes, Mapping):
        return list(axes.items())
    pairs = _sequence(axes, "Layout axes")
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise LayoutError(
                f"Layout axes are (name, size) pairs or a mapping, e.g. Layout([('dp', 2)]) or "
                f"Layout(dp=2); got {pair!r}"
            )
    return [tuple(pair) for pair in pairs]  # type: ignore[misc]


def _sequence(value: object, what: str) -> tuple[Any, ...]:
    """``value`` as a tuple; a string, a number or None is refused (not split into items)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise LayoutError(f"{what} must be a sequence (a tuple or list), got {value!r}")
    return tuple(value)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise LayoutError(f"an axis name must be a string, got {name!r}")
    return name


def _check_index(value: object, what: str) -> int:
    """A rank or coordinate: an int (numpy's too), not a bool, float or string."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _rank_tensor(mesh: object) -> npt.NDArray[np.int64]:
    """``from_mesh``'s rank tensor as int64; ragged, non-integer or huge input is refused."""
    try:
        raw = np.asarray(mesh)
    except (ValueError, TypeError) as exc:
        raise LayoutError(f"mesh must be a rectangular tensor of ranks: {exc}") from None
    if raw.size and (raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer)):
        raise LayoutError(f"mesh must hold integer ranks, got {raw.dtype} values: {mesh!r}")
    check_world_size(int(raw.size), "a mesh tensor")
    return raw.astype(np.int64)


def _check_size(name: str, size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise LayoutError(f"axis {name!r} must have an integer size >= 1, got {size!r}")
    return int(size)


def _check_unique(names: Sequence[str], what: str = "mesh_dim_names") -> None:
    dupes = sorted({n for n in names if list(names).count(n) > 1})
    if dupes:
        raise LayoutError(
            f"Each mesh_dim_name must be unique; {what} {tuple(names)} repeat {dupes}",
            upstream="RuntimeError",
        )


def _ravel(coords: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, s in zip(coords, sizes):
        index = index * int(s) + int(c)
    return index
