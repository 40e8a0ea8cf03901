"""AReaL builder: realhf's ``ParallelGrid`` replayed in plain torch, group by group.

realhf's ``topology.py`` is not on the package index in a form that installs, so this is the
only live side (there is no real adapter). The topology is a torch rank tensor over the grid's
axes; every group is made through one ``new_or_get_group`` cache per job (sorted members, one
object per member set and backend, so models over the same ranks share objects and, on a gloo
world, a group is its own gloo twin), in the order ``ParallelGrid.__init__`` makes them. A
process finds its coordinate as the grid does, from its rank in the model's process group, so
a ``rank_mapping`` that breaks rank order leaves it holding another coordinate's group, which
torch hands a non-member as ``GroupMember.NON_GROUP_MEMBER`` (observed as no group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshsim.builders._common import Entry, collect, degree, require
from meshsim.checks import Observation

# The grid's group attributes in the order it makes them (entries, hence observations, follow):
# names only, shared with the reference.
from meshsim.model.conventions.areal import KINDS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Axis orders realhf has a coordinate namedtuple for (``PROCESS_COORD_REGISTRY``).
_ORDERS: dict[str, tuple[str, ...]] = {
    "pipe_data_tensor": ("pipe", "data", "tensor"),
    "data_pipe_tensor": ("data", "pipe", "tensor"),
}
#: The kind naming the model's process group (``ParallelGrid``'s argument) in build_grids.
PROCESS_GROUP = "process_group"


class GroupCache:
    """realhf's ``new_or_get_group``: one group per (sorted ranks, backend), made on first ask.

    One cache per job, not per process: a warm gloo worker keeps its world between jobs.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], str], ProcessGroup] = {}
        self._world = str(dist.get_backend())

    def get(self, ranks: Sequence[int], backend: str | None = None) -> ProcessGroup:
        key_backend = self._world if backend is None else backend
        key = (tuple(sorted(ranks)), key_backend)
        if key not in self._groups:
            # The fake world has no gloo behind it: its twins are fake groups (metadata only).
            made = None if key_backend == self._world or self._world == "fake" else key_backend
            self._groups[key] = dist.new_group(list(key[0]), backend=made)
        return self._groups[key]


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    entries = build_grids(world_size, [config])[0]
    return collect({k: v for k, v in entries.items() if k != PROCESS_GROUP})


def build_grids(
    world_size: int, configs: Sequence[Mapping[str, Any]], cache: GroupCache | None = None
) -> list[dict[str, Entry]]:
    """Every model's grid in job order over one group cache: each model's entries, by kind,
    with its process group under :data:`PROCESS_GROUP` (this rank's objects, so a caller can
    tell which are one object)."""
    cache = GroupCache() if cache is None else cache
    return [_grid(world_size, config, cache) for config in configs]


def _topology(config: Mapping[str, Any]) -> tuple[str, ...]:
    value = config.get("topology") or "pipe_data_tensor"
    if isinstance(value, str):
        axes = tuple(a for a in value.replace("#", "_").split("_") if a)
    else:
        axes = tuple(value)
    name = "_".join(axes)
    require(
        name in _ORDERS,
        f"Corresponding coordinate namedtuple not implemented for axes {list(axes)}",
        upstream="KeyError",
    )
    return _ORDERS[name]


def _mapping(config: Mapping[str, Any]) -> dict[int, int] | None:
    raw = config.get("rank_mapping")
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return {int(k): int(v) for k, v in raw.items()}
    return {t: int(w) for t, w in enumerate(raw)}


def _grid(world_size: int, config: Mapping[str, Any], cache: GroupCache) -> dict[str, Entry]:
    axes = _topology(config)
    pp, tp = degree(config, "num_pp"), degree(config, "num_tp")
    mapping = _mapping(config)
    covered = world_size if mapping is None else len(mapping)
    if config.get("num_dp") is None:
        require(covered % (pp * tp) == 0, f"{covered} ranks are no pp × tp grid", upstream=None)
    dp = degree(config, "num_dp", covered // (pp * tp))
    sizes = {"pipe": pp, "data": dp, "tensor": tp}
    dims = [sizes[a] for a in axes]
    size = pp * dp * tp
    if mapping is None:
        mapping = {t: t for t in range(size)}
    extra = [k for k in mapping if not 0 <= k < size]
    require(not extra, f"rank_mapping names grid ranks {extra} outside the grid", upstream=None)
    model_ranks = [mapping[t] for t in range(size)]  # KeyError for a grid rank left out
    require(
        len(set(model_ranks)) == len(model_ranks),
        f"ranks list must not contain duplicate entries, got {sorted(model_ranks)}",
        upstream="ValueError",
    )
    process_group = cache.get(model_ranks)  # torch refuses ranks outside the world
    me = dist.get_rank(process_group)  # the grid's "global_rank": -1 outside the model
    grid = torch.arange(size).reshape(dims)

    def comm_lists(axis: str) -> list[list[int]]:
        i = axes.index(axis)
        return [[int(r) for r in row] for row in grid.movedim(i, -1).reshape(-1, dims[i])]

    def fixed(axis: str, index: int) -> list[int]:
        return sorted(int(r) for r in grid.select(axes.index(axis), index).flatten())

    def world(ranks: Sequence[int]) -> list[int]:
        return [mapping[t] for t in ranks]

    out: dict[str, Entry] = {PROCESS_GROUP: process_group, **dict.fromkeys(KINDS)}
    for d in range(dp):
        _assign(out, "ds_model_proc_group", fixed("data", d), me, cache, world, twin=True)
    for ranks in comm_lists("data"):
        _assign(out, "dp_proc_group", ranks, me, cache, world, twin=True)
    out["p2p_groups"] = _my_pair(comm_lists("pipe"), mapping)
    for ranks in comm_lists("pipe"):
        _assign(out, "pp_proc_group", ranks, me, cache, world, twin=True)
        tied = [ranks[0], ranks[-1]] if len(ranks) > 1 else ranks
        _assign(out, "embedding_proc_group", tied, me, cache, world)
        _assign(out, "position_embedding_proc_group", ranks[:1], me, cache, world)
    for ranks in comm_lists("tensor"):
        _assign(out, "slice_proc_group", ranks, me, cache, world, twin=True)
    for stage in range(pp):
        _assign(out, "tp_dp_proc_group", fixed("pipe", stage), me, cache, world)
    return out


def _assign(
    out: dict[str, Entry],
    name: str,
    ranks: list[int],
    me: int,
    cache: GroupCache,
    world: Callable[[Sequence[int]], list[int]],
    *,
    twin: bool = False,
) -> None:
    """Make the group (and its gloo twin) on every rank; keep it where the grid believes it is
    a member: ``me`` is a grid rank, ``ranks`` grid ranks, the group over their world ranks."""
    group = cache.get(world(ranks))
    gloo = cache.get(world(ranks), "gloo") if twin else None
    if me in ranks:
        out[name] = group
        if twin:
            out[f"{name}_gloo"] = gloo


def _my_pair(pipes: list[list[int]], mapping: Mapping[int, int]) -> tuple[int, int] | None:
    """This rank's row of ``grid.p2p_groups``: ``[world(t), world(next stage of t)]`` for the
    grid rank ``t`` on this world rank (None outside the grid)."""
    me = dist.get_rank()
    for ranks in pipes:
        for at, t in enumerate(ranks):
            if mapping[t] == me:
                return mapping[t], mapping[ranks[(at + 1) % len(ranks)]]
    return None


__all__ = ["PROCESS_GROUP", "GroupCache", "build", "build_grids"]
