"""Sweeps reach every config option that changes the groups (issue 31, item 7).

A bug in a code path that no listed layout takes survives ``sweep --real``: each framework's
sweep must hold the degrees the framework infers (``-1``, left out), each backend mode and order
string, and the other group-changing switches; ``varied_options`` / ``fixed_options`` say which
keys a sweep varies and why the others stay put.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import pytest

import meshsim
from meshsim.model.conventions import CONVENTIONS, convention
from meshsim.model.conventions import olmo_core as olmo
from meshsim.model.conventions import transformers as hf
from meshsim.model.conventions._megatron_options import _accepted, _signature, orders
from meshsim.model.conventions.megatron import DEFAULT_ORDER
from meshsim.model.conventions.torchtitan import _BACKENDS
from meshsim.model.sweep import (
    DEFAULT,
    LayoutCase,
    describe_options,
    fixed_options,
    spread,
    varied_options,
)

WORLDS = (1, 2, 4, 6, 8, 12, 16)


def _configs(framework: str, world: int = 8) -> list[dict[str, Any]]:
    return [dict(case.config) for case in meshsim.layouts(world, framework)]


def _groups(expected: meshsim.Expected) -> dict[str, Any]:
    """Every kind's groups, and each unavailable kind with the exception it names."""
    found: dict[str, Any] = {name: expected.groups(name) for name in expected.kinds()}
    found.update({n: ("unavailable", e.upstream) for n, e in expected.unavailable().items()})
    return found


def _same_groups(world: int, framework: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    left = meshsim.expect(framework, world, **a)
    right = meshsim.expect(framework, world, **b)
    assert _groups(left) == _groups(right), (framework, dict(a), dict(b))
    assert dict(left.roles) == dict(right.roles), (framework, dict(a), dict(b))


# -- spread ------------------------------------------------------------------------------------


def _features(config: Mapping[str, int], axes: tuple[str, ...]) -> set[frozenset[str]]:
    above = [a for a in axes if config.get(a, 1) > 1]
    return {frozenset(c) for n in (1, 2) for c in itertools.combinations(above, n)}


@pytest.mark.parametrize("world", [4, 8, 12, 16, 64])
def test_spread_keeps_every_axis_and_pair_that_any_layout_has(world: int) -> None:
    axes = ("pp", "dp", "cp", "tp")
    every = [dict(zip(axes, s)) for s in meshsim.model.sweep.ordered_factorizations(world, 4)]
    picked = spread(every, axes)
    assert all(p in every for p in picked)
    assert [p for p in every if p in picked] == picked  # the layouts' order kept
    wanted = set().union(*(_features(c, axes) for c in every))
    assert set().union(*(_features(c, axes) for c in picked)) == wanted
    assert len(picked) <= len(wanted)  # each pick adds an axis or a pair
    if world == 64:  # (2, 2, 2, 8) and its kind have every axis above 1 at once
        assert len(picked) == 1
    assert spread(every, axes) == picked  # the same on every run


def test_spread_reads_sizes_the_configs_do_not_spell() -> None:
    configs = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    sizes = {"a": {"tp": 8}, "b": {"dp": 2, "tp": 4}, "c": {"dp": 8}}
    assert spread(configs, ("dp", "tp"), lambda c: sizes[c["name"]]) == [{"name": "b"}]
    assert spread([{"tp": 1}], ("tp",)) == []  # nothing above 1: nothing to spread over
    assert spread([], ("tp",)) == []


# -- what each sweep holds ---------------------------------------------------------------------


def test_torchtitan_sweeps_every_backend_and_dp_shard_inferred_in_each_version() -> None:
    configs = _configs("torchtitan")
    for version in ("current", "intermediate", "legacy", "hyper_parallel"):
        mine = [c for c in configs if c["version"] == version]
        assert any(c["dp_shard"] == -1 for c in mine), version
        backends = {c.get("spmd_backend", _BACKENDS.get(version, (None,))[0]) for c in mine}
        assert backends == set(_BACKENDS.get(version, (None,))), version
    inferred = [c for c in configs if c["dp_shard"] == -1 and c["version"] == "current"]
    # the inference divides by every other degree: each is above 1 in some inferred case
    for key in ("dp_replicate", "cp", "tp", "pp"):
        assert any(c[key] > 1 for c in inferred), key


@pytest.mark.parametrize("world", [4, 8, 16])
def test_megatron_sweeps_every_order_that_changes_a_group(world: int) -> None:
    """An order string is listed unless, on every layout it takes, its groups are ones the
    sweep already holds (world 8: 2 of the 28)."""
    configs = _configs("megatron", world)
    listed = {c["order"] for c in configs if "order" in c}
    held = {_signature(world, c, c["order"]) for c in configs if "order" in c}
    base = [c for c in configs if c.get("order") == DEFAULT_ORDER and len(c) == 6]
    left_out = []
    for order in orders(DEFAULT_ORDER):
        if order in listed:
            continue
        left_out.append(order)
        for config in base:
            case = {**config, "order": order}
            assert not _accepted(world, case) or _signature(world, case, order) in held, case
    if world == 8:
        assert sorted(left_out) == ["tp-cp-pp-ep-dp", "tp-ep-cp-dp-pp"]


def test_megatron_sweeps_orders_optimizer_instances_and_cp_options() -> None:
    configs = _configs("megatron")
    swept = {c.get("order") for c in configs}
    assert len(set(orders(DEFAULT_ORDER)) & swept) == 26
    assert DEFAULT_ORDER.upper() in swept  # megatron lowercases it, but not for its pp check
    assert any(o and len(o.split("-")) < 5 for o in swept)  # size-1 axes left for it to append
    assert any(c.get("num_distributed_optimizer_instances", 1) > 1 for c in configs)
    assert any(len(c.get("hierarchical_context_parallel_sizes") or ()) > 1 for c in configs)
    assert any(c.get("hybrid_context_parallel") for c in configs)
    assert any(c.get("create_gloo_process_groups") is False for c in configs)
    assert any(c.get("create_all_gather_group") for c in configs)


def test_megatron_orders_arrange_every_dense_axis_order() -> None:
    found = orders(DEFAULT_ORDER)
    assert found[0] == DEFAULT_ORDER and len(found) == len(set(found)) == 28
    dense = {tuple(t for t in o.split("-") if t != "ep") for o in found}
    assert dense == set(itertools.permutations(("tp", "cp", "dp", "pp")))
    assert {o.split("-").index("ep") for o in found} == set(range(5))


def test_olmo_core_sweeps_each_way_it_splits_hsdp_and_resolves_ep() -> None:
    configs = _configs("olmo-core")
    hsdp = [c for c in configs if c.get("dp") == "hsdp"]
    assert any("shard_degree" in c and "num_replicas" not in c for c in hsdp)
    assert any("shard_degree" not in c and "num_replicas" not in c for c in hsdp)
    assert any(c.get("num_nodes", 1) > 1 for c in hsdp)
    assert any(c.get("ep", 0) < 0 for c in hsdp)
    assert {"expert_mesh_ep": -1} in configs
    assert any(c.get("tp") == 1 and c.get("cp") == 1 and c.get("pp") == 1 for c in configs)


@pytest.mark.parametrize(
    ("framework", "wanted"),
    [
        ("verl", lambda c: c.get("data_parallel_shard_size") == -1),
        ("verl", lambda c: c.get("expert_parallel_size", 1) > 1),
        ("areal-archon", lambda c: "dp_shard" not in c and c.get("ep", 1) > 1),
        ("areal-archon", lambda c: c.get("dp_shard", 0) > 1 and "dp_replicate" not in c),
        ("transformers", lambda c: "tp_plan" in c and "tp_size" not in c and "pp_size" in c),
        ("transformers", lambda c: "tp_plan" in c and "dp_replicate_size" in c),
        ("transformers", lambda c: "parallelism_config" in c and "tp_size" in c),
        ("transformers", lambda c: "parallelism_config" in c and "tp_size" not in c),
        ("deepspeed", lambda c: c == {}),
        ("deepspeed", lambda c: "num_pp" in c and "num_mp" not in c),
        ("lightning", lambda c: "data_parallel_size" in c and "tensor_parallel_size" not in c),
        ("lightning", lambda c: "tensor_parallel_size" in c and "data_parallel_size" not in c),
        ("torch", lambda c: "mesh" in c),
        ("torch", lambda c: any(str(op).startswith("unflatten") for op in c.get("ops", ()))),
        ("torch", lambda c: "fake" in (c.get("backend_override") or {}).values()),
        ("megatron-deepspeed", lambda c: c.get("pipeline_model_parallel_split_rank") == 1),
        ("megatron-deepspeed", lambda c: c.get("use_fp8") is False),
    ],
)
def test_each_framework_sweeps_the_options_that_change_its_groups(
    framework: str, wanted: Any
) -> None:
    assert any(wanted(c) for c in _configs(framework)), framework


@pytest.mark.parametrize("world", WORLDS)
def test_expect_takes_every_listed_config_and_ids_are_unique(world: int) -> None:
    cases = meshsim.layouts(world)
    assert len({case.id for case in cases}) == len(cases)
    for case in cases:
        case.expect()  # raises LayoutError for a config the framework refuses


# -- inferred degrees give the groups of the explicit ones --------------------------------------


def _explicit(world: int, framework: str, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """``config`` with every degree the framework infers spelt out, or None when it has none."""
    c = dict(config)
    if framework == "torchtitan" and c.get("dp_shard") == -1:
        return {**c, "dp_shard": meshsim.expect(framework, world, **c).config["dp_shard"]}
    if framework == "verl" and c.get("data_parallel_shard_size") == -1:
        others = ("data_parallel_replicate_size", "context_parallel_size")
        others += ("tensor_parallel_size", "pipeline_parallel_size")
        return {**c, "data_parallel_shard_size": world // math.prod(c.get(k, 1) for k in others)}
    if framework == "olmo-core":
        dims = dict(olmo.world_dims(world, c))
        if c.get("dp") == "hsdp" and "num_replicas" not in c:
            split = {"num_replicas": dims["dp_replicate"]}
            rest = {k: v for k, v in c.items() if k not in ("shard_degree", "num_nodes")}
            return {**rest, **split}
        if c.get("ep", 0) < 0:
            return {**c, "ep": dims["dp_shard"]}
        if c.get("expert_mesh_ep", 0) < 0:
            return {**c, "expert_mesh_ep": world}
    if framework == "areal-archon" and "dp_shard" not in c:
        return {"dp_shard": world // math.prod(c.get(k, 1) for k in ("pp", "cp", "tp")), **c}
    if framework == "transformers" and "tp_plan" in c and "tp_size" not in c:
        return {**c, "tp_size": hf.resolve(world, c)["tp_size"]}
    if framework == "transformers" and c.get("enable_expert_parallel"):
        return {
            **{k: v for k, v in c.items() if k != "enable_expert_parallel"},
            "ep_size": c["tp_size"],
        }
    if framework == "lightning" and {"data_parallel_size", "tensor_parallel_size"} - set(c):
        normal = meshsim.expect(framework, world, **c).config
        return {**c, **{k: normal[k] for k in ("data_parallel_size", "tensor_parallel_size")}}
    if framework == "deepspeed" and c == {}:
        normal = meshsim.expect(framework, world).config
        return {"num_pp": normal["dims"][0], "num_dp": normal["dims"][1]}
    if framework == "megatron" and c.get("order", DEFAULT_ORDER) != DEFAULT_ORDER:
        order = c["order"]
        if order != order.lower() or len(order.split("-")) < 5:  # spellings of the default
            return {**c, "order": DEFAULT_ORDER}
    return None


@pytest.mark.parametrize("world", [4, 8, 12])
@pytest.mark.parametrize(
    "framework",
    ["torchtitan", "verl", "olmo-core", "areal-archon", "transformers", "lightning", "deepspeed",
     "megatron"],
)  # fmt: skip
def test_an_inferred_degree_gives_the_groups_of_the_explicit_one(
    framework: str, world: int
) -> None:
    """What a planted inference bug would break: ``sweep --real`` holds the framework's groups
    for the inferred config against these, the explicit config's."""
    pairs = [
        (case.config, explicit)
        for case in meshsim.layouts(world, framework)
        if (explicit := _explicit(world, framework, case.config)) is not None
    ]
    if world == 8 or framework not in ("areal-archon", "lightning", "megatron"):
        assert pairs, f"{framework} at world {world}: no inferred case to check"
    for inferred, explicit in pairs:
        _same_groups(world, framework, inferred, explicit)


def test_the_check_of_inferred_degrees_can_fail() -> None:
    """dp_shard=-1 with a wrong explicit degree differs: the comparison sees groups."""
    with pytest.raises(AssertionError):
        _same_groups(
            8, "torchtitan", {"dp_shard": -1, "tp": 2}, {"dp_shard": 2, "dp_replicate": 2, "tp": 2}
        )


# -- varied_options / fixed_options ---------------------------------------------------------


@pytest.mark.parametrize("framework", list(CONVENTIONS))
def test_every_key_is_varied_at_world_8_or_says_why_not(framework: str) -> None:
    """The audit as a test: a new config key that changes groups must join the sweep, or its
    convention must say in ``SWEEP_FIXED`` why it need not."""
    module = convention(framework)
    varied = varied_options(framework, 8)
    fixed = fixed_options(framework, 8)
    assert set(varied) | set(fixed) == set(module.PARAMETERS)
    assert not set(varied) & set(fixed)
    reasons = getattr(module, "SWEEP_FIXED", {})
    assert set(fixed) == set(reasons), (
        f"{framework}: fixed without a reason: {set(fixed) - set(reasons)}"
    )
    for key, why in fixed.items():
        assert why.startswith(reasons[key]), key


def test_varied_options_list_each_value_the_sweep_gives() -> None:
    varied = varied_options("torchtitan", 8)
    assert varied["spmd_backend"] == (DEFAULT, "full_dtensor", "partial_dtensor")
    assert varied["dp_shard"] == (-1, 1, 2, 4, 8)
    assert varied["version"] == ("current", "hyper_parallel", "intermediate", "legacy")
    assert list(varied) == [k for k in convention("torchtitan").PARAMETERS if k in varied]
    assert repr(DEFAULT) == "default"


def test_options_of_the_cases_a_run_keeps() -> None:
    """``sweep --real`` keeps torchtitan's current line: its options, not the listing's."""
    kept = [c for c in meshsim.layouts(8, "torchtitan") if c.config["version"] == "current"]
    varied = varied_options("torchtitan", 8, cases=kept)
    assert "version" not in varied and varied["dp_shard"][0] == -1
    assert set(varied["spmd_backend"]) == {DEFAULT, "partial_dtensor", "full_dtensor"}
    fixed = fixed_options("torchtitan", 8, cases=kept)
    assert "every case sets 'current'" in fixed["version"]
    assert "no valid config" in fixed["version"]  # version has no reason of its own
    other = [LayoutCase("lightning", 8, {"num_nodes": 2})]
    assert varied_options("torchtitan", 8, cases=other) == {}  # another framework's cases


def test_world_1_varies_little_and_says_so() -> None:
    fixed = fixed_options("torchtitan", 1)
    assert "no valid config at world 1" in fixed["tp"]
    assert fixed["ulysses_degree"].startswith("hyper_parallel only")


def test_describe_options_shortens_long_values() -> None:
    lines = describe_options(varied_options("megatron", 8))
    assert "num_distributed_optimizer_instances: default, 2, 4" in lines
    grid = next(line for line in lines if line.startswith("hyper_comm_grid: "))
    assert grid.endswith("values)") and len(grid) < 250
    assert describe_options({"tp": (DEFAULT, 2)}) == ["tp: default, 2"]
