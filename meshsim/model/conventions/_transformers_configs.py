"""The configs the transformers convention sweeps (``meshsim.layouts(n, "transformers")``) and
those ``DistributedConfig`` / ``initialize_distributed_mesh`` refuse, apart from the reference."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshsim.model.sweep import above_one, divisors, ordered_factorizations, spread

__all__ = ["configs", "refused_configs"]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (pp, dp_replicate, fsdp, tp) split of the world that transformers accepts (no
    FSDP with PP), each alone and with every ``ep_size > 1`` it allows (a multiple of tp
    dividing fsdp * tp), sizes of 1 left out. Then the derived spellings: ``tp_plan="auto"``
    without ``tp_size`` (tp is what the other sizes leave) for each fsdp size and over a few
    splits (:func:`~meshsim.model.sweep.spread`), and the deprecated ``enable_expert_parallel``
    (ep = tp); then a few splits with the Trainer given a ``parallelism_config`` (the one it
    would build for a TP model, the model's data sizes otherwise). ``expert=False`` drops the
    EP configs. World 8 gives 38 configs (19 without EP); world 1 none (nothing is
    distributed).
    """
    expert = options.get("expert", True)
    dense: list[dict[str, Any]] = []
    for pp, dp_replicate, fsdp, tp in ordered_factorizations(world_size, 4):
        if (pp, dp_replicate, fsdp, tp) == (1, 1, 1, 1) or (pp > 1 and dp_replicate * fsdp > 1):
            continue
        sizes = above_one(pp_size=pp, dp_replicate_size=dp_replicate, fsdp_size=fsdp, tp_size=tp)
        dense.append(sizes)
        yield sizes
        if not expert:
            continue
        for k in divisors(fsdp):
            if tp * k > 1:
                yield {**sizes, "ep_size": tp * k}
    derived = [{"tp_plan": "auto", "fsdp_size": f} for f in divisors(world_size)[1:-1]]
    tensor = [c for c in dense if "tp_size" in c]
    for config in spread(tensor, _AXES):
        case = {"tp_plan": "auto", **{k: v for k, v in config.items() if k != "tp_size"}}
        if case not in derived:
            derived.append(case)
    yield from derived
    if expert and world_size > 1:
        yield {"tp_size": world_size, "enable_expert_parallel": True}
    for model_tp in (True, False):  # the Trainer's two paths: sizes set on it, or taken as given
        group = [c for c in dense if "pp_size" not in c and ("tp_size" in c) == model_tp]
        for config in spread(group, _AXES):
            yield {**config, "parallelism_config": _trainer_config(config)}


#: The sizes :func:`configs` spreads its derived spellings over.
_AXES = ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size")


def _trainer_config(config: dict[str, Any]) -> dict[str, int]:
    """The ``parallelism_config`` a user gives the Trainer for a model's sizes: for a TP model
    the one the Trainer builds itself (``tp_size``, ``dp_shard_size`` = every data rank), which
    it must equal; otherwise the model's data sizes, from which accelerate builds its mesh."""
    tp = config.get("tp_size", 1)
    replicas, shard = config.get("dp_replicate_size", 1), config.get("fsdp_size", 1)
    if tp > 1:
        return {"tp_size": tp, "dp_shard_size": replicas * shard}
    return above_one(dp_replicate_size=replicas, dp_shard_size=shard)


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
