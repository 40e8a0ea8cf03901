"""megatron-core's config checks, in the order ``initialize_model_parallel`` makes them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions._megatron_ranks import RankGenerator


@dataclass(frozen=True)
class Sizes:
    """Validated degrees, with the derived dp and edp."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    instances: int


def _quotient(world_size: int, what: str, degrees: Sequence[int], hint: str = "") -> int:
    """The data-parallel size the degrees leave, or the RuntimeError ``RankGenerator`` raises
    when their product does not divide the world."""
    product = math.prod(degrees)
    if world_size % product:
        raise LayoutError(
            f"world_size {world_size} is not divisible by {what} size "
            f"{'×'.join(map(str, degrees))} = {product}{hint}",
            upstream="RuntimeError",
        )
    return world_size // product


def validate(
    world_size: int, config: Mapping[str, Any], order: str
) -> tuple[Sizes, RankGenerator, RankGenerator]:
    """Upstream's checks, in upstream's order; returns the sizes and both generators."""
    tp = _degree(config, "tensor_model_parallel_size")
    pp = _degree(config, "pipeline_model_parallel_size")
    cp = _degree(config, "context_parallel_size")
    ep = _degree(config, "expert_model_parallel_size")
    etp = (
        tp
        if config.get("expert_tensor_parallel_size") is None
        else _degree(config, "expert_tensor_parallel_size")
    )
    instances = _degree(config, "num_distributed_optimizer_instances")
    vpp = config.get("virtual_pipeline_model_parallel_size")
    if vpp is not None:
        _degree(config, "virtual_pipeline_model_parallel_size")
    hcp = config.get("hierarchical_context_parallel_sizes")
    if hcp and (
        isinstance(hcp, (str, bytes))
        or not isinstance(hcp, Sequence)
        or not all(_is_degree(s) for s in hcp)
    ):
        raise LayoutError(
            f"hierarchical_context_parallel_sizes must be a list of integers >= 1, got {hcp!r}"
        )

    dp = _quotient(
        world_size,
        "tensor × pipeline × context parallel",
        (tp, pp, cp),
        "; choose degrees whose product divides the world",
    )
    if vpp is not None and not pp > 1:
        raise LayoutError(
            f"virtual_pipeline_model_parallel_size={vpp} (interleaved schedule) needs "
            f"pipeline_model_parallel_size > 1, got {pp}",
            upstream="RuntimeError",
        )
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    edp = _quotient(world_size, "expert tensor × expert model × pipeline parallel", (etp, ep, pp))
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    # Upstream tests the order string as given (not lowercased) here.
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise LayoutError(
            f"order {order!r} does not end with 'pp', so attention and MoE layers need the same "
            f"data-parallel size, but dense dp = {dp} and expert dp = {edp}; put pp last or "
            "choose expert sizes with etp×ep = tp×cp",
            upstream="AssertionError",
        )
    if decoder.get_ranks("pp") != expert.get_ranks("pp"):
        raise LayoutError(
            f"order {order!r} gives the dense and expert grids different pipeline groups "
            f"({decoder.get_ranks('pp')} vs {expert.get_ranks('pp')}); megatron-core requires "
            "them to match",
            upstream="AssertionError",
        )
    if (dp * cp) % instances:
        raise LayoutError(
            f"dp×cp = {dp}×{cp} = {dp * cp} is not divisible by "
            f"num_distributed_optimizer_instances={instances}",
            upstream="AssertionError",
        )
    if config.get("hybrid_context_parallel") and (dp * cp) % 2:
        raise LayoutError(
            f"hybrid context parallel needs an even dp×cp group, got {dp}×{cp} = {dp * cp}",
            upstream="AssertionError",
        )
    if hcp and math.prod(hcp) != cp:
        raise LayoutError(
            f"hierarchical_context_parallel_sizes {list(hcp)} multiply to {math.prod(hcp)}, "
            f"not context_parallel_size={cp}",
            upstream="AssertionError",
        )
    if edp % instances:
        raise LayoutError(
            f"expert data-parallel size {edp} is not divisible by "
            f"num_distributed_optimizer_instances={instances}",
            upstream="AssertionError",
        )
    return Sizes(tp, pp, cp, ep, etp, dp, edp, instances), decoder, expert


def flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean switch (megatron takes any truthy value; meshsim wants True or False)."""
    value = config.get(key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise LayoutError(f"{key} must be True or False, got {value!r}")
    return bool(value)


def _is_degree(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 1)


def _degree(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key, 1)
    if not _is_degree(value):
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)
