"""The configs the DeepSpeed convention sweeps (``meshsim.layouts(n, "deepspeed")``) and those
DeepSpeed refuses, kept apart from the reference so each module has one job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshsim.model.conventions._deepspeed_groups import MP_MODES
from meshsim.model.sweep import divisors, ordered_factorizations

__all__ = ["configs", "refused_configs"]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every ``PipeModelDataParallelTopology`` of ``world_size``; then the topologies DeepSpeed
    picks itself: ``PipelineParallelGrid``'s default split (``{}``: no topology given) and
    ``PipeDataParallelTopology`` (``num_mp`` left out: no model axis) for each (pipe, data)
    split. Then each ``PipeModelDataParallelTopology`` with every MoE ``ep > 1`` dividing
    ``num_dp``, in E + D and D + E layouts, each with ``enable_expert_tensor_parallelism`` False
    and True, then (``num_mp > 1``) the direct ``mp_size=num_mp`` call in both ``mp_mode`` s
    (``moe=False`` skips the MoE configs). The two MoE-layer paths differ only when
    ``num_mp > 1``; both are swept everywhere so that the sweep shows they agree otherwise.
    ``helpers=False`` skips the rest: a bare ``(pipe, data)`` topology (``grid=False``) for each
    split, and AutoTP / ``_create_model_parallel`` for every size. World 8 gives 75 configs;
    :func:`refused_configs` lists the rejected ones."""
    shapes = list(ordered_factorizations(world_size, 3))
    for num_pp, num_mp, num_dp in shapes:
        yield {"num_pp": num_pp, "num_mp": num_mp, "num_dp": num_dp}
    yield {}
    for num_pp, num_dp in ordered_factorizations(world_size, 2):
        yield {"num_pp": num_pp, "num_dp": num_dp}
    if options.get("moe", True):
        yield from _moe_configs(shapes)
    if not options.get("helpers", True):
        return
    for outer, inner in ordered_factorizations(world_size, 2):
        yield {"axes": ["pipe", "data"], "dims": [outer, inner], "grid": False}
    for size in divisors(world_size):
        yield {"num_pp": 1, "num_mp": 1, "num_dp": world_size, "autotp_size": size}
        yield {"num_pp": 1, "num_mp": 1, "num_dp": world_size, "model_parallel_size": size}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs DeepSpeed rejects, each with the exception it raises (``expect`` raises a
    ``LayoutError`` with that ``upstream``): a grid over a topology without ``pipe`` or ``data``
    (``AttributeError``), D + E with ``mp_size > 1`` (``NotImplementedError``), an ``ep`` that
    does not divide a stage or the grid's data size (``AssertionError``)."""
    for outer, inner in ordered_factorizations(world_size, 2):
        yield {"axes": ["data", "model"], "dims": [outer, inner], "grid": True}
        yield {"axes": ["pipe", "model"], "dims": [outer, inner], "grid": True}
    for num_pp, num_mp, num_dp in ordered_factorizations(world_size, 3):
        if num_mp > 1 and num_dp > 1:
            ep = divisors(num_dp)[1]
            yield {
                "num_pp": num_pp,
                "num_mp": num_mp,
                "num_dp": num_dp,
                "ep": ep,
                "mp_size": num_mp,
                "use_data_before_expert_parallel_": True,
            }
        if num_mp > 1 and num_dp > 1 and num_dp * num_mp > num_dp:
            yield {
                "num_pp": num_pp,
                "num_mp": num_mp,
                "num_dp": num_dp,
                "ep": num_dp * num_mp,
                "enable_expert_tensor_parallelism": True,
            }


def _moe_configs(shapes: list[tuple[int, ...]]) -> Iterator[dict[str, Any]]:
    for num_pp, num_mp, num_dp in shapes:
        base = {"num_pp": num_pp, "num_mp": num_mp, "num_dp": num_dp}
        for ep in divisors(num_dp)[1:]:
            for before in (False, True):
                for expert_tp in (False, True):
                    yield {
                        **base,
                        "ep": ep,
                        "use_data_before_expert_parallel_": before,
                        "enable_expert_tensor_parallelism": expert_tp,
                    }
            if num_mp > 1:
                for mode in MP_MODES:
                    yield {**base, "ep": ep, "mp_size": num_mp, "mp_mode": mode}
