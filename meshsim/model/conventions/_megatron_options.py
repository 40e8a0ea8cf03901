"""The megatron-core sweep's option cases: each config option that changes the groups
``initialize_model_parallel`` builds, over a few layouts rather than all of them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions._megatron_config import validate
from meshsim.model.sweep import divisors, ordered_factorizations, spread

__all__ = ["option_configs", "orders"]

TP, CP, PP = "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size"
EP, ETP = "expert_model_parallel_size", "expert_tensor_parallel_size"
#: The dense axes an order string arranges (ep is placed among them by :func:`orders`).
_DENSE: Final = ("tp", "cp", "dp", "pp")


def option_configs(
    world_size: int, layouts: Sequence[Mapping[str, Any]], swept: Sequence[str]
) -> Iterator[dict[str, Any]]:
    """The option cases after the layouts swept in every order of ``swept``.

    ``layouts`` are the valid configs in the first of ``swept``. Over a few of them
    (:func:`~meshsim.model.sweep.spread`): each ``num_distributed_optimizer_instances`` > 1
    that divides, a two-level ``hierarchical_context_parallel_sizes`` of cp (one level where cp
    is prime), ``hybrid_context_parallel``, ``create_gloo_process_groups=False`` and
    ``create_all_gather_group=True``; then each order string of :func:`orders` not in
    ``swept``, on one layout that gives groups no earlier case gave (an order that gives none
    at this world size changes no group here, and is left out); an order that leaves out its
    size-1 axes (megatron appends them) and one in capitals (megatron lowercases it, but tests
    ``endswith("pp")`` on the string as given).
    """

    def sizes(config: Mapping[str, Any]) -> dict[str, int]:
        return _sizes(world_size, config)

    picked = spread(layouts, ("tp", "cp", "dp", "pp", "ep", "etp"), sizes)
    shared = [c for c in layouts if _instances(world_size, c)]
    for config in spread(shared, ("tp", "cp", "dp", "pp", "ep"), sizes):
        for k in _instances(world_size, config):
            yield {**config, "num_distributed_optimizer_instances": k}
    with_cp = [c for c in layouts if c[CP] > 1]
    composite = [c for c in with_cp if len(divisors(c[CP])) > 2]
    for config in spread(composite or with_cp, ("tp", "dp", "pp", "ep"), sizes):
        splits = [list(s) for s in ordered_factorizations(config[CP], 2) if 1 not in s]
        for split in splits or [[config[CP]]]:
            yield from _valid(world_size, {**config, "hierarchical_context_parallel_sizes": split})
    even = [c for c in layouts if _sizes(world_size, c)["dp"] * c[CP] % 2 == 0]
    for config in spread(even, ("tp", "cp", "dp", "pp"), sizes):
        yield from _valid(world_size, {**config, "hybrid_context_parallel": True})
    for config in picked:
        yield {**config, "create_gloo_process_groups": False}
    for config in picked:
        yield {**config, "create_all_gather_group": True}
    yield from _order_configs(world_size, layouts, swept)


def orders(default: str) -> list[str]:
    """Every arrangement of the dense axes tp, cp, dp, pp, with ep just before dp as in
    ``default``; then ep at each other place in ``default``. 28 orders, ``default`` first:
    every relative order of the dense grid, and of ep against the default one."""
    found = ["-".join(_with_ep(p)) for p in itertools.permutations(_DENSE)]
    dense = [t for t in default.split("-") if t != "ep"]
    found += ["-".join([*dense[:i], "ep", *dense[i:]]) for i in range(len(dense) + 1)]
    return list(dict.fromkeys([default, *found]))


def _with_ep(dense: Sequence[str]) -> list[str]:
    at = dense.index("dp")
    return [*dense[:at], "ep", *dense[at:]]


def _order_configs(
    world_size: int, layouts: Sequence[Mapping[str, Any]], swept: Sequence[str]
) -> Iterator[dict[str, Any]]:
    seen = {_signature(world_size, c, order) for c in layouts for order in swept}
    # Layouts with more axes above 1 first: they show more of an order.
    ranked = sorted(layouts, key=lambda c: -sum(v > 1 for v in _sizes(world_size, c).values()))
    for order in orders(swept[0]):
        if order in swept:
            continue
        for config in ranked:
            case = {**config, "order": order}
            signature = _signature(world_size, case, order)
            if signature not in seen and _accepted(world_size, case):
                seen.add(signature)
                yield case
                break
    short = [c for c in ranked if c[CP] == 1 and c[EP] == 1 and c[TP] > 1]
    if short:
        config = short[0]
        sizes = _sizes(world_size, config)
        order = "-".join(t for t in swept[0].split("-") if sizes.get(t, 1) > 1) or "tp"
        yield from _valid(world_size, {**config, "order": order})
    upper = [c for c in ranked if c[PP] > 1 and _sizes(world_size, c)["dp"] > 1]
    for config in upper:
        case = {**config, "order": swept[0].upper()}
        if _accepted(world_size, case):
            yield case
            break


def _instances(world_size: int, config: Mapping[str, Any]) -> list[int]:
    """Each ``num_distributed_optimizer_instances`` > 1 the layout takes: a divisor of dp×cp
    and of the expert dp."""
    s = _sizes(world_size, config)
    edp = world_size // (s["etp"] * s["ep"] * s["pp"])
    return [k for k in divisors(s["dp"] * s["cp"])[1:] if edp % k == 0]


def _sizes(world_size: int, config: Mapping[str, Any]) -> dict[str, int]:
    """The axis sizes of a config: tp, cp, dp, pp, ep and etp (dp and the expert one derived)."""
    tp, cp, pp = config.get(TP, 1), config.get(CP, 1), config.get(PP, 1)
    ep = config.get(EP, 1)
    etp = config.get(ETP) or tp
    return {"tp": tp, "cp": cp, "dp": world_size // (tp * cp * pp), "pp": pp, "ep": ep, "etp": etp}


def _signature(world_size: int, config: Mapping[str, Any], order: str) -> tuple[Any, ...]:
    """What decides a config's groups under ``order``: the sizes and, in each grid, the order
    of the axes above 1 (size-1 axes can move anywhere without changing a group)."""
    s = _sizes(world_size, config)
    edp = world_size // (s["etp"] * s["ep"] * s["pp"])
    dense = {"tp": s["tp"], "cp": s["cp"], "dp": s["dp"], "pp": s["pp"], "ep": 1}
    expert = {"tp": s["etp"], "cp": 1, "dp": edp, "pp": s["pp"], "ep": s["ep"]}
    tokens = order.lower().split("-")
    return (
        tuple(sorted(s.items())),
        tuple(t for t in tokens if dense.get(t, 1) > 1),
        tuple(t for t in tokens if expert.get(t, 1) > 1),
    )


def _accepted(world_size: int, config: Mapping[str, Any]) -> bool:
    s = _sizes(world_size, config)
    edp = world_size // (s["etp"] * s["ep"] * s["pp"])
    if not (config["order"].endswith("pp") or s["pp"] == 1 or edp == s["dp"]):
        return False  # validate's AssertionError, known without building the generators
    try:
        validate(world_size, config, config["order"])
    except LayoutError:
        return False
    return True


def _valid(world_size: int, config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if _accepted(world_size, config):
        yield config
