"""The configs the OLMo-core convention sweeps (``meshsim.layouts(n, "olmo-core")``), apart
from the reference so that module keeps to one job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from meshsim.model.sweep import divisors, ordered_factorizations

__all__ = ["DP_TYPES", "configs", "refused_configs"]

#: ``DataParallelType`` values the reference takes and the sweep tries; kept here, below the
#: reference, so that neither module imports the other back.
DP_TYPES: Final = ("ddp", "fsdp", "hsdp")


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every valid OLMo-core config: no config, then each dp type x factorizations of pp/cp/tp.

    A degree of 1 is left out (config absent) to keep sweeps small; present size-1 configs are
    covered by the tests instead. HSDP splits the DP world every way (``num_replicas``) and adds
    EP (= the shard degree, when > 1) where tp is absent. ``dp_types=`` restricts the dp types;
    ``expert_mesh=False`` drops the ``build_expert_parallel_mesh`` configs (one per divisor).
    World 8 gives 90 configs.
    """
    dp_types = tuple(options.get("dp_types", DP_TYPES))
    yield {}
    for pp, cp, tp, dp_world in ordered_factorizations(world_size, 4):
        degrees = {key: d for key, d in (("pp", pp), ("cp", cp), ("tp", tp)) if d > 1}
        for dp in dp_types:
            if dp != "hsdp":
                yield {"dp": dp, **degrees}
                continue
            for replicas in divisors(dp_world):
                yield {"dp": dp, "num_replicas": replicas, **degrees}
                shard = dp_world // replicas
                if tp == 1 and shard > 1:
                    yield {"dp": dp, "num_replicas": replicas, "ep": shard, **degrees}
    if options.get("expert_mesh", True):
        for ep in divisors(world_size):
            yield {"expert_mesh_ep": ep}


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
