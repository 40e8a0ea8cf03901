"""The configs the OLMo-core convention sweeps (``meshsim.layouts(n, "olmo-core")``), apart
from the reference so that module keeps to one job."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Final

from meshsim.model.sweep import divisors, ordered_factorizations, spread

__all__ = ["DP_TYPES", "configs", "refused_configs"]

#: ``DataParallelType`` values the reference takes and the sweep tries; kept here, below the
#: reference, so that neither module imports the other back.
DP_TYPES: Final = ("ddp", "fsdp", "hsdp")


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every valid OLMo-core config: no config, then each dp type x factorizations of pp/cp/tp.

    A degree of 1 is left out (config absent) to keep sweeps small. HSDP splits the DP world
    every way (``num_replicas``) and adds EP (= the shard degree, when > 1) where tp is absent.
    ``dp_types=`` restricts the dp types; ``expert_mesh=False`` drops the
    ``build_expert_parallel_mesh`` configs (one per divisor). Then the spellings that reach
    another code path (:func:`option_configs`). World 8 gives 104 configs.
    """
    dp_types = tuple(options.get("dp_types", DP_TYPES))
    listed: list[dict[str, Any]] = [{}]
    for pp, cp, tp, dp_world in ordered_factorizations(world_size, 4):
        degrees = {key: d for key, d in (("pp", pp), ("cp", cp), ("tp", tp)) if d > 1}
        for dp in dp_types:
            if dp != "hsdp":
                listed.append({"dp": dp, **degrees})
                continue
            for replicas in divisors(dp_world):
                listed.append({"dp": dp, "num_replicas": replicas, **degrees})
                shard = dp_world // replicas
                if tp == 1 and shard > 1:
                    listed.append({"dp": dp, "num_replicas": replicas, "ep": shard, **degrees})
    yield from listed
    expert_mesh = options.get("expert_mesh", True)
    if expert_mesh:
        for ep in divisors(world_size):
            yield {"expert_mesh_ep": ep}
    yield from option_configs(world_size, listed, dp_types, expert_mesh)


def option_configs(
    world_size: int,
    listed: list[dict[str, Any]],
    dp_types: tuple[str, ...] = DP_TYPES,
    expert_mesh: bool = True,
) -> Iterator[dict[str, Any]]:
    """The configs whose degrees OLMo-core works out itself, or whose size-1 configs are
    present, each over a few of the ``listed`` layouts (``spread``): the HSDP split given as
    ``shard_degree`` (replicas derived) or not at all (``num_nodes`` decides: 1, and each
    divisor of the world), ``ep=-1`` (the shard degree), ``expert_mesh_ep=-1`` (the whole
    world), and every pp/cp/tp config present at degree 1 (a size-1 mesh dim each)."""
    hsdp = [c for c in listed if c.get("dp") == "hsdp"]
    splits = [c for c in hsdp if "ep" not in c]
    both = [c for c in splits if 1 < c["num_replicas"] < _dp_world(world_size, c)]
    for config in spread(both or splits, _AXES):
        split = {"shard_degree": _dp_world(world_size, config) // config["num_replicas"]}
        yield {**{k: v for k, v in config.items() if k != "num_replicas"}, **split}
    if "hsdp" in dp_types:
        for nodes in divisors(world_size):
            yield {"dp": "hsdp", **({"num_nodes": nodes} if nodes > 1 else {})}
    for config in spread([c for c in hsdp if "ep" in c], _AXES):
        yield {**config, "ep": -1}
    if expert_mesh:
        yield {"expert_mesh_ep": -1}
    for dp in dp_types:
        split = {"num_replicas": 1} if dp == "hsdp" else {}
        yield {"dp": dp, **split, "pp": 1, "cp": 1, "tp": 1}


def _dp_world(world_size: int, config: dict[str, Any]) -> int:
    return world_size // math.prod(config.get(k, 1) for k in ("pp", "cp", "tp"))


#: The degrees :func:`option_configs` spreads its cases over.
_AXES: Final = ("pp", "cp", "tp", "num_replicas", "ep")


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs OLMo-core 3.0.0 (or torch under it) rejects at ``world_size``, one per way.

    TP without a data-parallel config, a degree that does not divide the world, cp not
    dividing what pp leaves, EP without HSDP, EP beside TP, EP other than the shard degree,
    an HSDP split bigger than the world, one with a shard degree of 0, EP checked before the
    split, and expert meshes of degree 0 or not dividing the world (OLMoConfigurationError,
    RuntimeError or ZeroDivisionError; ``meshsim.expect`` says which).
    """
    if world_size < 2:
        return
    smallest = divisors(world_size)[1]
    stray = next(d for d in range(2, world_size + 2) if world_size % d)
    yield {"tp": smallest}
    yield {"dp": "fsdp", "tp": stray}
    yield {"dp": "hsdp", "num_replicas": stray}
    if smallest < world_size:
        yield {"dp": "fsdp", "pp": smallest, "cp": world_size}
    yield {"dp": "fsdp", "ep": smallest}
    if world_size % (smallest * smallest) == 0:
        yield {"dp": "hsdp", "tp": smallest, "ep": smallest}
    # EP must equal the shard degree: the whole world as ep over a shard degree of 1.
    yield {"dp": "hsdp", "num_replicas": world_size, "ep": world_size}
    yield {"dp": "hsdp", "num_replicas": world_size, "shard_degree": world_size}
    yield {"dp": "hsdp", "num_nodes": 2 * world_size}
    yield {"dp": "hsdp", "num_replicas": 1, "shard_degree": 1, "ep": smallest}
    yield {"expert_mesh_ep": 0}
    yield {"expert_mesh_ep": stray}
