"""The configs the AReaL grid convention sweeps (``meshsim.layouts(n, "areal")``) and those AReaL
refuses, kept apart from the reference so each module has one job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshsim.model.sweep import ordered_factorizations

__all__ = ["configs", "refused_configs"]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every ``(num_pp, num_dp, num_tp)`` of the world in both topologies; then, on an even
    world, every split of half the world placed on the first half (the default mapping), on the
    second half in both topologies, and on the even ranks. World 8 gives 44 configs.

    ``unordered=True`` adds, for every split of the world, the mapping that reverses rank order
    (grid rank ``t`` on world rank ``world - 1 - t``): AReaL then leaves ranks without their
    groups, which only the fake tier can observe (on a communicating tier the members of such a
    group disagree about it, and meshsim reports that instead of proving it).
    """
    shapes = list(ordered_factorizations(world_size, 3))
    for topology in ("pipe_data_tensor", "data_pipe_tensor"):
        for pp, dp, tp in shapes:
            yield _config(pp, dp, tp, topology)
    if world_size % 2 == 0 and world_size > 1:
        half = world_size // 2
        for pp, dp, tp in ordered_factorizations(half, 3):
            yield _config(pp, dp, tp, "pipe_data_tensor")
        for topology in ("pipe_data_tensor", "data_pipe_tensor"):
            for pp, dp, tp in ordered_factorizations(half, 3):
                yield _config(pp, dp, tp, topology, list(range(half, world_size)))
        for pp, dp, tp in ordered_factorizations(half, 3):
            yield _config(pp, dp, tp, "pipe_data_tensor", list(range(0, world_size, 2)))
    if options.get("unordered", False):
        for pp, dp, tp in shapes:
            yield _config(pp, dp, tp, "pipe_data_tensor", list(range(world_size))[::-1])


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs AReaL refuses, each with the exception it raises (``expect`` raises a
    ``LayoutError`` with that ``upstream``): axis orders without a coordinate namedtuple
    (``KeyError``), a ``rank_mapping`` missing a grid rank (``KeyError``), world ranks outside
    the world or given twice, and a grid larger than the world (torch's ``new_group``:
    ``ValueError``)."""
    for topology in ("pipe_tensor_data", "tensor_data_pipe", "pipe_data_model"):
        yield {"num_dp": world_size, "topology": topology}
    yield {"num_dp": world_size, "rank_mapping": {r: r for r in range(world_size - 1)}}
    yield {"num_dp": world_size, "rank_mapping": list(range(1, world_size + 1))}
    yield {"num_dp": 2, "rank_mapping": [0, 0]}
    yield {"num_dp": 2 * world_size}


def _config(
    pp: int, dp: int, tp: int, topology: str, rank_mapping: list[int] | None = None
) -> dict[str, Any]:
    config: dict[str, Any] = {"num_pp": pp, "num_dp": dp, "num_tp": tp}
    if topology != "pipe_data_tensor":
        config["topology"] = topology
    if rank_mapping is not None:
        config["rank_mapping"] = rank_mapping
    return config
