"""The configs the transformers convention sweeps (``meshsim.layouts(n, "transformers")``) and
those ``DistributedConfig`` / ``initialize_distributed_mesh`` refuse, apart from the reference."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshsim.model.sweep import above_one, divisors, ordered_factorizations

__all__ = ["configs", "refused_configs"]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (pp, dp_replicate, fsdp, tp) split of the world that transformers accepts (no
    FSDP with PP), each alone and with every ``ep_size > 1`` it allows (a multiple of tp
    dividing fsdp * tp), sizes of 1 left out. Then the two derived spellings: ``tp_plan="auto"``
    without ``tp_size`` (tp is what the other sizes leave) and the deprecated
    ``enable_expert_parallel`` (ep = tp). ``expert=False`` drops the EP configs. World 8 gives
    34 configs (15 without EP); world 1 none (nothing is distributed).
    """
    expert = options.get("expert", True)
    for pp, dp_replicate, fsdp, tp in ordered_factorizations(world_size, 4):
        if (pp, dp_replicate, fsdp, tp) == (1, 1, 1, 1) or (pp > 1 and dp_replicate * fsdp > 1):
            continue
        sizes = above_one(pp_size=pp, dp_replicate_size=dp_replicate, fsdp_size=fsdp, tp_size=tp)
        yield sizes
        if not expert:
            continue
        for k in divisors(fsdp):
            if tp * k > 1:
                yield {**sizes, "ep_size": tp * k}
    for fsdp in divisors(world_size):
        if 1 < fsdp < world_size:
            yield {"tp_plan": "auto", "fsdp_size": fsdp}
    if expert and world_size > 1:
        yield {"tp_size": world_size, "enable_expert_parallel": True}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs transformers rejects, each with the exception it raises (``expect`` raises a
    ``LayoutError`` with that ``upstream``): a size below 1, a plan of the wrong type, an
    ``ep_size`` that is no multiple of tp or does not divide fsdp * tp, FSDP with PP (all
    ``ValueError`` from ``DistributedConfig``), a ``tp_plan`` whose derived tp does not divide
    (``ValueError``), and sizes whose product is not the world (``RuntimeError`` from
    ``initialize_distributed_mesh``)."""
    yield {"tp_size": 0}
    yield {"fsdp_size": world_size, "ep_plan": "auto"}
    yield {"fsdp_size": world_size, "fsdp_plan": ["layers"]}
    yield {"fsdp_size": world_size * 2}
    yield {"pp_size": 2, "fsdp_size": 2}
    yield {"tp_plan": "auto", "fsdp_size": world_size + 1}
    if world_size % 4 == 0:
        yield {"fsdp_size": world_size // 2, "tp_size": 2, "ep_size": 3}
        yield {"fsdp_size": world_size // 2, "tp_size": 2, "ep_size": 4 * world_size}
