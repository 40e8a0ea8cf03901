"""AReaL's ``ParallelGrid`` as rank arithmetic: its topology, its ``rank_mapping`` and who holds
which group, vectorised (a million-rank grid costs a few numpy passes).

The grid works in *grid ranks* (a topology coordinate's row-major index) and builds every group
over the world ranks ``rank_mapping`` gives them, sorted (``new_or_get_group`` sorts). A process
finds its own coordinate from ``dist.get_rank(process_group)``, its index among the model's world
ranks in ascending order, which is its grid rank only when the mapping keeps rank order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from meshsim.errors import LayoutError
from meshsim.model.layout import Layout

#: Axis orders with a coordinate namedtuple in ``PROCESS_COORD_REGISTRY`` (config name -> axes).
TOPOLOGIES: Final[Mapping[str, tuple[str, str, str]]] = {
    "pipe_data_tensor": ("pipe", "data", "tensor"),
    "data_pipe_tensor": ("data", "pipe", "tensor"),
}
#: The topology classes that build those orders.
TOPOLOGY_CLASSES: Final[Mapping[str, str]] = {
    "pipe_data_tensor": "PipeDataTensorParallelTopology",
    "data_pipe_tensor": "DataPipeTensorParallelTopology",
}

Rows = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Grid:
    """One model's grid: topology axes and sizes, and grid rank -> world rank.

    Example: ``Grid(("pipe", "data", "tensor"), (2, 2, 2), np.arange(8) + 8)`` puts the grid on
    world ranks 8-15; its data-parallel rows are ``[[8, 10], [9, 11], [12, 14], [13, 15]]``.
    """

    axes: tuple[str, ...]
    dims: tuple[int, ...]
    mapping: npt.NDArray[np.int64]

    @property
    def size(self) -> int:
        return int(self.mapping.size)

    def dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)]

    @cached_property
    def layout(self) -> Layout:
        """The topology over grid ranks (row-major, last axis fastest)."""
        return Layout(list(zip(self.axes, self.dims)))

    @cached_property
    def placed(self) -> Layout:
        """The topology as placed on the world: each coordinate holds its world rank."""
        if self.mapping[0] == 0 and self.keeps_order and self.mapping[-1] == self.size - 1:
            return self.layout
        return Layout.from_mesh(self.mapping.reshape(self.dims), names=self.axes)

    @cached_property
    def keeps_order(self) -> bool:
        """True when grid rank order is world rank order: every process then finds its own
        coordinate (``dist.get_rank(process_group)`` is its grid rank)."""
        return bool(np.all(np.diff(self.mapping) > 0))

    @cached_property
    def believed(self) -> npt.NDArray[np.int64]:
        """Grid rank ``t`` -> the grid rank its process takes itself for: the position of its
        world rank among the model's world ranks, ascending."""
        if self.keeps_order:
            return np.arange(self.size, dtype=np.int64)
        believed = np.empty(self.size, dtype=np.int64)
        believed[np.argsort(self.mapping, kind="stable")] = np.arange(self.size, dtype=np.int64)
        return believed

    # -- the grid's own rank lists (grid ranks) --------------------------------------------
    def comm_lists(self, axis: str) -> Rows:
        """``get_axis_comm_lists(axis)``: groups along ``axis``, row-major over the others."""
        return self.layout.groups_array(axis)

    def fixed(self, axis: str) -> Rows:
        """Row ``i``: ``sorted(get_axis_list(axis, i))``, the grid ranks whose ``axis`` is ``i``."""
        others = [a for a in self.axes if a != axis]
        return np.sort(self.layout.groups_array(*others), axis=1)

    def embedding(self) -> Rows:
        """First and last stage of every pipe group; the whole group when it has one stage."""
        pipes = self.comm_lists("pipe")
        return pipes if pipes.shape[1] == 1 else pipes[:, [0, -1]]

    def position_embedding(self) -> Rows:
        """The first stage of every pipe group."""
        return self.comm_lists("pipe")[:, :1]

    def p2p(self) -> Rows:
        """``_build_p2p_groups``: row ``t`` is ``[world(t), world(next stage of t)]``."""
        pipes = self.comm_lists("pipe")
        following = np.empty(self.size, dtype=np.int64)
        following[pipes] = np.roll(pipes, -1, axis=1)
        grid = np.arange(self.size, dtype=np.int64)
        return np.stack([self.mapping[grid], self.mapping[following]], axis=1)

    # -- as the world sees them ------------------------------------------------------------
    def world_rows(self, rows: Rows) -> Rows:
        """The groups ``new_or_get_group`` makes: each row's world ranks, ascending."""
        return np.sort(self.mapping[rows], axis=1)

    def holders(self, rows: Rows, world_size: int) -> npt.NDArray[np.int64]:
        """World rank -> index of the row whose group it holds, -1 for none.

        A process assigns the group of the row holding the grid rank it *believes* is its own;
        that group holds the process only when its true grid rank sits in the same row. A rank
        outside the grid (``dist.get_rank(process_group) == -1``) holds nothing.
        """
        row_of = np.full(self.size, -1, dtype=np.int64)
        row_of[rows] = np.arange(rows.shape[0], dtype=np.int64)[:, None]
        mine = row_of[self.believed]
        held = np.where((mine >= 0) & (mine == row_of), mine, -1)
        owner = np.full(world_size, -1, dtype=np.int64)
        owner[self.mapping] = held
        return owner


def parse(world_size: int, config: Mapping[str, Any]) -> Grid:
    """The grid a config describes, refused as AReaL (or torch under it) refuses it."""
    names = _topology(config.get("topology"))
    num_pp = _degree("num_pp", config.get("num_pp"))
    num_tp = _degree("num_tp", config.get("num_tp"))
    raw = config.get("rank_mapping")
    mapping = None if raw is None else _mapping(raw)
    num_dp = config.get("num_dp")
    if num_dp is None:
        covered = world_size if mapping is None else len(mapping)
        if covered % (num_pp * num_tp):
            raise LayoutError(
                f"num_dp not given and {covered} ranks do not split into num_pp {num_pp} × "
                f"num_tp {num_tp}; give num_dp"
            )
        num_dp = covered // (num_pp * num_tp)
    num_dp = _degree("num_dp", num_dp)
    sizes = {"pipe": num_pp, "data": num_dp, "tensor": num_tp}
    axes = TOPOLOGIES[names]
    dims = tuple(sizes[a] for a in axes)
    size = num_pp * num_dp * num_tp
    if mapping is None:
        mapping = np.arange(size, dtype=np.int64)
    else:
        mapping = _check_keys(mapping, size)
    _check_world(mapping, world_size)
    return Grid(axes, dims, mapping)


def _topology(value: object) -> str:
    """The config's topology name; an axis order without a coordinate namedtuple is refused
    as ``ProcessTopology.__init__`` refuses it (``KeyError``)."""
    if value is None:
        return "pipe_data_tensor"
    if isinstance(value, str):
        axes = [a for a in value.replace("#", "_").split("_") if a]
    elif isinstance(value, Sequence) and all(isinstance(a, str) for a in value):
        axes = list(value)
    else:
        raise LayoutError(f"topology must be a name such as 'pipe_data_tensor', got {value!r}")
    name = "_".join(axes)
    if name not in TOPOLOGIES:
        raise LayoutError(
            f"Corresponding coordinate namedtuple not implemented for axes {axes}: AReaL's "
            f"PROCESS_COORD_REGISTRY knows only {[list(a) for a in TOPOLOGIES.values()]}",
            upstream="KeyError",
        )
    return name


def _degree(key: str, value: object) -> int:
    if value is None:
        return 1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)


def _mapping(raw: object) -> dict[int, int]:
    """``rank_mapping`` as a dict: a mapping as given, a sequence indexed by grid rank."""
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, (Sequence, np.ndarray)) and not isinstance(raw, (str, bytes)):
        items = list(enumerate(raw))
    else:
        raise LayoutError(f"rank_mapping must be a dict or a list, got {type(raw).__name__}")
    for key, value in items:
        for what, x in (("grid rank", key), ("world rank", value)):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise LayoutError(f"rank_mapping {what}s must be integers, got {x!r}")
    return {int(k): int(v) for k, v in items}


def _check_keys(mapping: dict[int, int], size: int) -> npt.NDArray[np.int64]:
    missing = [r for r in range(size) if r not in mapping]
    if missing:
        raise LayoutError(
            f"rank_mapping has no world rank for grid rank {missing[0]} (the grid has {size} "
            f"ranks; missing {_few(missing)}): ParallelGrid looks every grid rank up",
            upstream="KeyError",
        )
    extra = sorted(k for k in mapping if not 0 <= k < size)
    if extra:
        # The grid would ignore them, but the model's process group (its callers make it over
        # every mapped world rank) would then hold ranks outside the grid.
        raise LayoutError(
            f"rank_mapping names grid ranks {_few(extra)} the {size}-rank grid does not have"
        )
    return np.fromiter((mapping[r] for r in range(size)), dtype=np.int64, count=size)


def _check_world(mapping: npt.NDArray[np.int64], world_size: int) -> None:
    """torch's ``new_group`` checks, hit first by the model's process group."""
    outside = mapping[(mapping < 0) | (mapping >= world_size)]
    if outside.size:
        raise LayoutError(
            f"Rank {int(outside[0])} is out of range. Valid ranks are 0 to {world_size - 1} "
            f"(world_size={world_size}): the grid's world ranks must lie in the world",
            upstream="ValueError",
        )
    if not np.all(np.diff(mapping) > 0) and np.unique(mapping).size != mapping.size:
        values, counts = np.unique(mapping, return_counts=True)
        raise LayoutError(
            f"rank_mapping gives world ranks {_few(values[counts > 1].tolist())} to several grid "
            "ranks: torch's new_group refuses a ranks list with duplicate entries",
            upstream="ValueError",
        )


def _few(values: Sequence[int]) -> str:
    shown = ", ".join(map(str, values[:4]))
    return f"[{shown}{', ...' if len(values) > 4 else ''}]"
