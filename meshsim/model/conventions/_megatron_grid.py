"""megatron-core's ``HyperCommGrid``: a named N-d grid whose ``create_pg(dims)`` makes one family.

The semantics modelled (megatron-core 0.16.1, ``megatron/core/hyper_comm_grid.py``):

* ``dim_names`` list the grid's dims fastest first, like ``initialize_model_parallel``'s order
  string: ``HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])`` is ``order="tp-cp-dp"``. The grid holds
  the ranks ``rank_offset .. rank_offset + prod(shape) - 1``; it may be smaller than the world
  (ranks outside it get no group), never larger.
* ``create_pg(dims)`` builds every group spanning ``dims``. A list of names is reordered
  slowest first, and that order joined by ``-`` is the key the grid stores the group under
  (``["cp", "dp"]`` on the grid above is ``"dp-cp"``); a single string is used as given. The
  groups list their ranks ascending, as ``new_subgroups_by_enumeration`` makes them.
* Refusals, each with the exception type the framework raises: ``len(shape) != len(dim_names)``
  and a negative ``rank_offset`` (``ValueError``), a grid larger than the world past the offset
  (``RuntimeError``), a list naming an unknown dim (``ValueError``), an empty list
  (``TypeError``), a second ``create_pg`` of a stored key (``KeyError``), and what ``einops``
  refuses when the groups are enumerated (``EinopsError``): dim names that are not identifiers
  or start or end with ``_``, repeated dim names, a string that names no dim, a list naming one
  dim twice. The last two groups of checks run only when a ``create_pg`` runs.

meshsim's config takes the grid as ``hyper_comm_grid={"shape": [...], "dim_names": [...],
"pgs": [...], "rank_offset": 0}``; each entry of ``pgs`` is one ``create_pg`` call (a string, or
a list / tuple of names, which the real adapter passes as a list). Kinds are named
``hyper_comm_grid[KEY]`` after the grid's stored key, so ``get_pg(dims)`` returns that kind's
group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions._megatron_ranks import IntArray
from meshsim.model.expected import Kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout

#: The keys of the ``hyper_comm_grid`` config value, each with its meaning.
GRID_KEYS: Final[Mapping[str, str]] = {
    "shape": "grid size per dim, fastest dim first (as dim_names)",
    "dim_names": "one name per dim, fastest first (HyperCommGrid's order)",
    "pgs": "create_pg calls, in order: a dim name or a list of dim names each",
    "rank_offset": "first rank of the grid (default 0)",
}

#: One ``create_pg`` argument: a string is passed as a string, a sequence as a list.
PgDims = str | tuple[str, ...]


@dataclass(frozen=True)
class GridSpec:
    """A ``hyper_comm_grid`` config value, type-checked (not yet checked against the world)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    pgs: tuple[PgDims, ...]
    rank_offset: int

    def as_config(self) -> dict[str, Any]:
        """The normalised config value (lists, so it reads as the framework's arguments)."""
        return {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names),
            "pgs": [d if isinstance(d, str) else list(d) for d in self.pgs],
            "rank_offset": self.rank_offset,
        }


def parse_spec(value: object) -> GridSpec:
    """Type-check a ``hyper_comm_grid`` config value (meshsim's own errors, no upstream)."""
    if not isinstance(value, Mapping):
        raise LayoutError(
            f"hyper_comm_grid must be a mapping with keys {list(GRID_KEYS)}, got {value!r}"
        )
    unknown = sorted(set(value) - set(GRID_KEYS))
    missing = [k for k in ("shape", "dim_names") if k not in value]
    if unknown or missing:
        raise LayoutError(
            f"hyper_comm_grid takes keys {list(GRID_KEYS)} (shape and dim_names required); "
            f"unknown: {unknown}, missing: {missing}"
        )
    shape = _sequence(value["shape"], "shape")
    if not all(_is_size(s) for s in shape):
        raise LayoutError(f"hyper_comm_grid shape must hold integers >= 1, got {list(shape)}")
    names = _sequence(value["dim_names"], "dim_names")
    if not all(isinstance(n, str) for n in names):
        raise LayoutError(f"hyper_comm_grid dim_names must be strings, got {list(names)}")
    offset = value.get("rank_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise LayoutError(f"hyper_comm_grid rank_offset must be an integer, got {offset!r}")
    return GridSpec(
        tuple(int(s) for s in shape),
        tuple(names),
        tuple(_pg_dims(d) for d in _sequence(value.get("pgs", ()), "pgs")),
        int(offset),
    )


def check_grid(world_size: int, spec: GridSpec) -> None:
    """The constructor's checks, in its order."""
    if len(spec.shape) != len(spec.dim_names):
        raise LayoutError(
            f"HyperCommGrid shape {list(spec.shape)} has {len(spec.shape)} dims but dim_names "
            f"{list(spec.dim_names)} has {len(spec.dim_names)}",
            upstream="ValueError",
        )
    if spec.rank_offset < 0:
        raise LayoutError(
            f"HyperCommGrid rank_offset must be >= 0, got {spec.rank_offset}", upstream="ValueError"
        )
    size = math.prod(spec.shape)
    if size > world_size - spec.rank_offset:
        raise LayoutError(
            f"HyperCommGrid shape {list(spec.shape)} holds {size} ranks, more than the "
            f"{world_size - spec.rank_offset} of world {world_size} from rank_offset "
            f"{spec.rank_offset}",
            upstream="RuntimeError",
        )


def group_key(dim_names: Sequence[str], dims: PgDims) -> tuple[tuple[str, ...], str]:
    """The dims ``create_pg(dims)`` spans, slowest first, and the key it stores them under.

    Example: dim_names ``["tp", "cp", "dp"]``, dims ``("dp", "tp")`` -> ``(("dp", "tp"),
    "dp-tp")``; dims ``"cp"`` -> ``(("cp",), "cp")`` (a string is taken as given, unchecked).
    """
    if isinstance(dims, str):
        return (dims,), dims
    slowest_first = list(reversed(dim_names))
    unknown = [d for d in dims if d not in slowest_first]
    if unknown:
        raise LayoutError(
            f"create_pg({list(dims)}) names {unknown}, not among dim_names {list(dim_names)}",
            upstream="ValueError",
        )
    if not dims:
        raise LayoutError("create_pg([]) spans no dim", upstream="TypeError")
    ordered = tuple(slowest_first[i] for i in sorted(slowest_first.index(d) for d in dims))
    return ordered, "-".join(ordered)


def check_enumerable(dim_names: Sequence[str], ordered: Sequence[str]) -> None:
    """What ``einops`` refuses when ``create_pg`` enumerates the groups of ``ordered``."""
    bad = [n for n in dim_names if not _einops_name(n)]
    if bad:
        raise LayoutError(
            f"HyperCommGrid dim names {bad} are not einops axis names (a Python identifier "
            "that neither starts nor ends with '_')",
            upstream="EinopsError",
        )
    repeated = sorted({n for n in dim_names if dim_names.count(n) > 1})
    if repeated:
        raise LayoutError(
            f"HyperCommGrid dim_names repeat {repeated}; einops cannot enumerate the groups",
            upstream="EinopsError",
        )
    unknown = [d for d in ordered if d not in dim_names]
    if unknown:
        raise LayoutError(
            f"create_pg({ordered[0]!r}) names no dim of {list(dim_names)}", upstream="EinopsError"
        )
    twice = sorted({d for d in ordered if ordered.count(d) > 1})
    if twice:
        raise LayoutError(f"create_pg names {twice} twice", upstream="EinopsError")


def rank_enum(spec: GridSpec, ordered: Sequence[str]) -> IntArray:
    """Every group spanning ``ordered`` (checked), ranks ascending, groups by first rank."""
    layout = Layout(list(zip(reversed(spec.dim_names), reversed(spec.shape))))
    return layout.groups_array(*ordered) + spec.rank_offset


def grid_kinds(world_size: int, spec: GridSpec) -> list[Kind]:
    """One kind per ``create_pg`` call, in call order; refusals raise :class:`LayoutError`."""
    check_grid(world_size, spec)
    covers_world = spec.rank_offset == 0 and math.prod(spec.shape) == world_size
    kinds: list[Kind] = []
    stored: set[str] = set()
    for dims in spec.pgs:
        ordered, key = group_key(spec.dim_names, dims)
        if key in stored:
            raise LayoutError(
                f"HyperCommGrid.create_pg({_call_text(dims)}): a group for {key!r} was already "
                "created; megatron-core refuses to create it twice",
                upstream="KeyError",
            )
        check_enumerable(spec.dim_names, ordered)
        stored.add(key)
        kinds.append(
            Kind(
                f"hyper_comm_grid[{key}]",
                f"HyperCommGrid.create_pg({_call_text(dims)}) / get_pg: groups over {key}",
                _groups(spec, ordered),
                partition=covers_world,
            )
        )
    return kinds


def _groups(spec: GridSpec, ordered: tuple[str, ...]) -> Any:
    return lambda: Groups.from_array(rank_enum(spec, ordered))


def _call_text(dims: PgDims) -> str:
    return repr(dims) if isinstance(dims, str) else repr(list(dims))


def _einops_name(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_") and not name.endswith("_")


def _is_size(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _sequence(value: object, key: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise LayoutError(f"hyper_comm_grid {key} must be a list, got {value!r}")
    return tuple(value)


def _pg_dims(value: object) -> PgDims:
    if isinstance(value, str):
        return value
    dims = _sequence(value, "pgs entry")
    if not all(isinstance(d, str) for d in dims):
        raise LayoutError(f"a hyper_comm_grid pgs entry names dims by string, got {value!r}")
    return tuple(dims)
