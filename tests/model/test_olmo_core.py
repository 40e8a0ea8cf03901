"""OLMo-core convention: build_world_mesh dims, every getter, errors, and properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import olmo_core
from meshsim.model.invariants import find_violations
from tests.model._tt_olmo_helpers import assert_invariants, assert_same_groups, cases


def olmo(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("olmo-core", world, **config)


def dims(exp: meshsim.Expected) -> dict[str, int]:
    assert exp.layout is not None
    return dict(zip(exp.layout.root_names, exp.layout.root_shape))


WORLD = tuple(range(8))
GETTERS = tuple(olmo_core._GETTERS)


# -- the conventions.md table --------------------------------------------------------------------
def test_no_config_is_a_1d_dp_mesh() -> None:
    exp = olmo(8)
    assert dims(exp) == {"dp": 8}
    for kind in ("dp", "get_dp_mesh", "get_dp_process_group", "get_dp_model_mesh"):
        assert exp.groups(kind) == [WORLD]
    assert set(exp.unavailable()) == {
        "get_tp_mesh",
        "get_cp_mesh",
        "get_pp_mesh",
        "get_pp_stage_mesh",
        "get_ep_mesh",
        "get_dp_shard_mesh",
        "get_dp_replicate_mesh",
    }
    # No data-parallel config: the loader splits batches over the dp mesh, but OLMo applies no
    # DDP/FSDP, so nothing reduces the gradients: a finding on more than one rank.
    assert dict(exp.roles) == {"data_parallel": "get_dp_process_group"}
    (violation,) = find_violations(exp)
    assert violation.check == "gradient_reduce ⊇ data_parallel"
    assert "are in no gradient-reduce group" in violation.message
    assert find_violations(olmo(1)) == []


def test_a_data_parallel_config_names_the_gradient_group() -> None:
    exp = olmo(8, dp="ddp")
    assert exp.roles["gradient_reduce"] == exp.roles["loss"] == "get_dp_model_mesh"


@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_ddp_fsdp_with_tp(dp: str) -> None:
    exp = olmo(8, dp=dp, tp=2)
    assert dims(exp) == {"dp": 4, "tp": 2}
    dp_groups = [(0, 2, 4, 6), (1, 3, 5, 7)]
    for kind in ("dp", "get_dp_mesh", "get_dp_process_group", "get_dp_model_mesh"):
        assert exp.groups(kind) == dp_groups
    assert exp.groups("get_tp_mesh") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert "get_pp_stage_mesh" in exp.unavailable()
    assert exp.kind_of("tensor") == "get_tp_mesh"


@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_ddp_fsdp_with_cp_folds_cp_into_the_model_mesh_only(dp: str) -> None:
    exp = olmo(8, dp=dp, cp=2, tp=2)
    assert dims(exp) == {"dp": 2, "cp": 2, "tp": 2}
    data = [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("get_dp_mesh") == data  # CP peers read the same data
    assert exp.groups("get_dp_process_group") == data
    model = [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("get_dp_model_mesh") == model
    assert exp.groups("dp_cp") == model
    assert exp.kind("get_dp_model_mesh").mesh_dims == ("dp_cp",)
    assert exp.groups("get_cp_mesh") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("get_tp_mesh") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert str(exp.unavailable()["get_dp_shard_mesh"]) == (
        "could not determine data parallel shard sub-mesh from mesh with dimensions ('dp_cp', 'tp')"
    )


def test_hsdp_with_tp_has_a_2d_dp_mesh_and_a_flattened_process_group() -> None:
    exp = olmo(8, dp="hsdp", num_replicas=2, tp=2)
    assert dims(exp) == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    dp_mesh = exp.kind("get_dp_mesh")
    assert dp_mesh.mesh_dims == ("dp_replicate", "dp_shard")
    assert dp_mesh.mesh_shape == (2, 2)
    assert exp.groups("get_dp_mesh") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.kind("get_dp_process_group").mesh_dims == ("dp",)
    assert exp.groups("dp") == exp.groups("get_dp_process_group") == exp.groups("get_dp_mesh")
    assert exp.kind("get_dp_model_mesh").mesh_dims == ("dp_replicate", "dp_shard")
    assert (
        exp.groups("get_dp_shard_mesh")
        == exp.groups("get_ep_mesh")
        == [
            (0, 2),
            (1, 3),
            (4, 6),
            (5, 7),
        ]
    )
    assert exp.groups("get_dp_replicate_mesh") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert "expert" not in exp.roles  # get_ep_mesh exists, but EP is not configured


def test_hsdp_with_cp_folds_dp_shard_and_cp_into_dp_cp() -> None:
    exp = olmo(16, dp="hsdp", num_replicas=2, cp=2, tp=2)
    assert dims(exp) == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}
    model = exp.kind("get_dp_model_mesh")
    assert model.mesh_dims == ("dp_replicate", "dp_cp")
    assert model.mesh_shape == (2, 4)
    assert exp.groups("get_dp_model_mesh") == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    assert exp.groups("dp_cp") == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert exp.groups("get_dp_mesh") == [
        (0, 4, 8, 12),
        (1, 5, 9, 13),
        (2, 6, 10, 14),
        (3, 7, 11, 15),
    ]
    assert exp.groups("get_ep_mesh") == exp.groups("dp_shard")
    assert exp.groups("get_dp_replicate_mesh") == exp.groups("dp_replicate")
    error = exp.unavailable()["get_dp_shard_mesh"]
    assert error.upstream == "RuntimeError"
    assert str(error) == (
        "could not determine data parallel shard sub-mesh from mesh with dimensions "
        "('dp_replicate', 'dp_cp', 'tp')"
    )


@pytest.mark.parametrize(
    "config",
    [{"dp": "ddp"}, {"dp": "fsdp", "cp": 2}, {"dp": "hsdp", "num_replicas": 2}],
    ids=["ddp", "fsdp-cp", "hsdp"],
)
def test_pp_is_prepended_and_excluded_from_dp(config: dict[str, Any]) -> None:
    exp = olmo(16, pp=2, **config)
    without = olmo(8, **config)
    assert next(iter(dims(exp))) == "pp"
    assert exp.groups("get_pp_mesh") == [(i, i + 8) for i in range(8)]
    assert exp.kind_of("pipeline") == "get_pp_mesh"
    for kind in ("get_dp_mesh", "get_dp_model_mesh", "get_dp_process_group"):
        stage0 = [g for g in exp.groups(kind) if g[0] < 8]
        assert meshsim.Groups(stage0) == without.groups(kind), kind
    assert exp.groups("get_pp_stage_mesh") == [tuple(range(8)), tuple(range(8, 16))]
    assert exp.kind("get_pp_stage_mesh").mesh_dims == tuple(dims(without))


def test_hsdp_with_ep_reuses_dp_shard() -> None:
    exp = olmo(8, dp="hsdp", num_replicas=2, ep=4)
    assert dims(exp) == {"dp_replicate": 2, "dp_shard": 4}  # no 'ep' dim
    assert exp.groups("get_ep_mesh") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.kind_of("expert") == "get_ep_mesh"
    assert exp.groups("expert") == exp.groups("dp_shard")
    assert exp.groups("get_dp_model_mesh") == [WORLD]


def test_ep_below_zero_takes_the_shard_degree() -> None:
    assert dims(olmo(8, dp="hsdp", num_replicas=4, ep=-1)) == {"dp_replicate": 4, "dp_shard": 2}


def test_expert_parallel_mesh() -> None:
    exp = olmo(8, expert_mesh_ep=4)
    assert exp.groups("ep_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("ep_shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for kind in ("expert:dp", "expert:get_dp_mesh", "expert:get_dp_process_group"):
        assert exp.groups(kind) == [WORLD]  # ep_replicate + ep_shard flattened to 'dp'
    assert exp.groups("expert:get_dp_model_mesh") == [WORLD]
    assert exp.groups("expert:get_ep_mesh") == exp.groups("ep_shard")
    assert exp.kind_of("expert") == "expert:get_ep_mesh"
    assert exp.kind_of("expert_data") == "ep_replicate"
    assert str(exp.unavailable()["expert:get_tp_mesh"]) == (
        "could not determine tensor parallel sub-mesh from mesh with dimensions ('dp',)"
    )
    assert str(exp.unavailable()["expert:get_cp_mesh"]) == (
        "could not determine context parallel sub-mesh from mesh with dimensions "
        "('ep_replicate', 'ep_shard')"
    )
    whole = olmo(8, expert_mesh_ep=-1)
    assert whole.groups("ep_shard") == [WORLD]
    assert whole.groups("ep_replicate").group_size == 1


def test_expert_mesh_beside_a_world_mesh() -> None:
    exp = olmo(8, dp="hsdp", num_replicas=2, ep=4, expert_mesh_ep=2)
    assert exp.groups("get_ep_mesh") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("expert:get_ep_mesh") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.kind_of("expert") == "expert:get_ep_mesh"


# -- details of build_world_mesh ------------------------------------------------------------------
def test_a_present_config_of_degree_one_makes_a_size_one_dim() -> None:
    exp = olmo(4, dp="fsdp", pp=1, cp=1, tp=1)
    assert dims(exp) == {"pp": 1, "dp": 4, "cp": 1, "tp": 1}
    assert exp.groups("get_cp_mesh").group_size == 1
    assert exp.groups("get_tp_mesh").group_size == 1
    assert exp.kind("get_dp_model_mesh").mesh_dims == ("dp_cp",)
    assert exp.groups("get_dp_model_mesh") == exp.groups("get_dp_mesh") == [(0, 1, 2, 3)]


@pytest.mark.parametrize(
    ("split", "expected"),
    [
        ({}, (1, 8)),
        ({"num_nodes": 2}, (2, 4)),
        ({"num_replicas": 4}, (4, 2)),
        ({"shard_degree": 4}, (2, 4)),
        ({"num_replicas": 2, "shard_degree": 4}, (2, 4)),
    ],
)
def test_hsdp_split(split: dict[str, int], expected: tuple[int, int]) -> None:
    shape = dims(olmo(8, dp="hsdp", **split))
    assert (shape["dp_replicate"], shape["dp_shard"]) == expected


def test_num_replicas_and_shard_degree_are_ignored_without_hsdp() -> None:
    assert dims(olmo(8, dp="fsdp", num_replicas=2)) == {"dp": 8}


# -- errors, in OLMo's order -----------------------------------------------------------------------
OLMO_ERRORS = [
    ({"tp": 2}, "Data parallel config is required in addition to expert/tensor/context/"),
    ({"dp": "fsdp", "pp": 3}, "PipelineParallelConfig.degree must be at least 1 and divide"),
    ({"dp": "fsdp", "pp": 0}, "PipelineParallelConfig.degree must be at least 1"),
    ({"dp": "fsdp", "pp": 4, "cp": 4}, "ContextParallelConfig.degree must be at least 1"),
    ({"dp": "fsdp", "cp": 2, "tp": 8}, "TensorParallelConfig.degree must be at least 1"),
    ({"dp": "fsdp", "tp": -2}, "TensorParallelConfig.degree must be at least 1"),
    ({"dp": "hsdp", "ep": 0}, "ExpertParallelConfig.degree must be at least 1"),
    ({"dp": "hsdp", "ep": 3}, "ExpertParallelConfig.degree must be at least 1"),
    ({"dp": "hsdp", "tp": 2, "ep": 2}, "expert parallelism is mutually exclusive with tensor"),
    ({"dp": "fsdp", "ep": 2}, "expert parallelism can currently only be used with HSDP"),
    ({"dp": "ddp", "ep": 2}, "expert parallelism can currently only be used with HSDP"),
    (
        {"dp": "hsdp", "num_replicas": 3},
        "data parallel world size (8) must be divisible by 'num_replicas' (3)",
    ),
    (
        {"dp": "hsdp", "shard_degree": 3},
        "data parallel world size (8) must be divisible by 'shard_degree' (3)",
    ),
    (
        {"dp": "hsdp", "num_replicas": 4, "ep": 4},
        "expert parallelism + HSDP requires the same sharding degree",
    ),
    (
        {"expert_mesh_ep": 3},
        "Expert parallelism requires world size (8) to be divisible by 'degree' (3)",
    ),
]


@pytest.mark.parametrize(("config", "message"), OLMO_ERRORS, ids=lambda v: str(v)[:40])
def test_configuration_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError) as info:
        olmo(8, **config)
    assert str(info.value).startswith(message)
    assert info.value.upstream == "OLMoConfigurationError"


def test_validation_order_pp_then_cp_then_tp_then_ep() -> None:
    # Every degree is wrong; the first checked wins.
    bad = {"dp": "fsdp", "pp": 3, "cp": 3, "tp": 3, "ep": 3}
    for key in ("pp", "cp", "tp"):
        with pytest.raises(LayoutError, match=olmo_core._CONFIG_CLASS[key]):
            olmo(8, **bad)
        bad[key] = 1
    with pytest.raises(LayoutError, match="ExpertParallelConfig"):
        olmo(8, **bad)
    # pp and cp divide what is left of the world in turn: 8 / 4 leaves 2, so cp=4 fails.
    with pytest.raises(LayoutError, match="ContextParallelConfig"):
        olmo(8, dp="fsdp", pp=4, cp=4)
    # The missing dp config is reported before any degree.
    with pytest.raises(LayoutError, match="Data parallel config is required"):
        olmo(8, pp=3)


@pytest.mark.parametrize(
    ("config", "message", "upstream"),
    [
        ({"dp": "zero"}, "dp must be one of", "ValueError"),
        ({"dp": "fsdp", "tp": "2"}, "tp must be an integer degree or None", None),
        ({"dp": "hsdp", "num_replicas": 0}, "num_replicas must be an integer >= 1", None),
        ({"dp": "hsdp", "num_nodes": "2"}, "num_nodes must be an integer degree or None", None),
        ({"expert_mesh_ep": 0}, "build_expert_parallel_mesh with degree 0", "ZeroDivisionError"),
        ({"dp": "fsdp", "degree": 2}, "olmo-core takes no config key(s) ['degree']", None),
    ],
)
def test_meshsim_refusals(config: dict[str, Any], message: str, upstream: str | None) -> None:
    with pytest.raises(LayoutError) as info:
        olmo(8, **config)
    assert str(info.value).startswith(message)
    assert info.value.upstream == upstream


@pytest.mark.parametrize(
    ("world", "config", "message", "upstream"),
    [
        (
            8,
            {"dp": "hsdp", "num_replicas": 2, "shard_degree": 2},
            "HSDP split num_replicas=2 x shard_degree=2 covers 4 of the 8 data-parallel ranks, "
            "so OLMo builds its world mesh ('dp_replicate', 'dp_shard') = (2, 2) on ranks 0-3 of "
            "8 only, and ranks 4-7, outside it, fail in get_dp_process_group with IndexError "
            "(list index out of range) in get_group; choose num_replicas x shard_degree = 8",
            "IndexError",
        ),
        (
            8,
            {"dp": "hsdp", "num_nodes": 3},
            "HSDP split num_replicas=num_nodes=3 x shard_degree=8//3=2 covers 6 of the 8 "
            "data-parallel ranks, so OLMo builds its world mesh ('dp_replicate', 'dp_shard') = "
            "(3, 2) on ranks 0-5 of 8 only, and ranks 6-7, outside it,",
            "IndexError",
        ),
        (  # EP adds no dim: the DP mesh is still the whole world mesh
            8,
            {"dp": "hsdp", "num_nodes": 3, "ep": -1},
            "HSDP split num_replicas=num_nodes=3 x shard_degree=8//3=2 covers 6 of the 8",
            "IndexError",
        ),
        (  # with other dims, get_dp_mesh slices the world mesh first
            16,
            {"dp": "hsdp", "num_nodes": 3, "pp": 2, "tp": 2},
            "HSDP split num_replicas=num_nodes=3 x shard_degree=4//3=1 covers 3 of the 4 "
            "data-parallel ranks, so OLMo builds its world mesh ('pp', 'dp_replicate', "
            "'dp_shard', 'tp') = (2, 3, 1, 2) on ranks 0-11 of 16 only, and ranks 12-15, outside "
            "it, fail in get_dp_process_group with RuntimeError slicing the world mesh",
            "RuntimeError",
        ),
        (  # a size-1 cp dim: the sliced DP mesh still spans the whole world mesh
            8,
            {"dp": "hsdp", "num_nodes": 7, "cp": 1},
            "HSDP split num_replicas=num_nodes=7 x shard_degree=8//7=1 covers 7 of the 8 "
            "data-parallel ranks, so OLMo builds its world mesh ('dp_replicate', 'dp_shard', "
            "'cp') = (7, 1, 1) on ranks 0-6 of 8 only, and rank 7, outside it, fail in "
            "get_dp_process_group with IndexError",
            "IndexError",
        ),
        (
            8,
            {"dp": "hsdp", "num_nodes": 3, "cp": 2},
            "HSDP split num_replicas=num_nodes=3 x shard_degree=4//3=1 covers 3 of the 4 "
            "data-parallel ranks, so OLMo builds its world mesh ('dp_replicate', 'dp_shard', "
            "'cp') = (3, 1, 2) on ranks 0-5 of 8 only, and ranks 6-7, outside it, fail in "
            "get_dp_process_group with RuntimeError",
            "RuntimeError",
        ),
        (
            8,
            {"dp": "hsdp", "num_replicas": 4, "shard_degree": 4},
            "HSDP split num_replicas=4 x shard_degree=4 = 16 exceeds the data parallel world size "
            "8, so init_device_mesh refuses OLMo's world mesh ('dp_replicate', 'dp_shard') = "
            "(4, 4): Mesh should not be bigger than default world size 8, but found 16 ranks!",
            "RuntimeError",
        ),
        (
            8,
            {"dp": "hsdp", "num_nodes": 16},
            "HSDP split num_replicas=num_nodes=16 x shard_degree=8//16=0 has a shard degree of 0",
            "ZeroDivisionError",
        ),
    ],
)
def test_hsdp_split_not_covering_the_world(
    world: int, config: dict[str, Any], message: str, upstream: str
) -> None:
    """OLMo does not check num_replicas x shard_degree against the DP world; torch and the ranks
    outside a too-small mesh do. The error is the one the ranks outside the mesh see first."""
    with pytest.raises(LayoutError) as info:
        olmo(world, **config)
    assert str(info.value).startswith(message)
    assert info.value.upstream == upstream


def test_ep_shard_check_comes_before_the_split_check() -> None:
    """build_world_mesh checks ep == shard_degree before init_device_mesh sees the split."""
    with pytest.raises(LayoutError, match="requires the same sharding degree") as info:
        olmo(8, dp="hsdp", num_replicas=2, shard_degree=2, ep=4)
    assert info.value.upstream == "OLMoConfigurationError"


def test_get_dp_mesh_refuses_a_mesh_with_dp_cp() -> None:
    with pytest.raises(LayoutError, match="'get_dp_mesh' should be called on the original world"):
        olmo_core.get_dp_mesh(meshsim.Layout(dp_cp=4))


# -- configs() -------------------------------------------------------------------------------------
def test_configs_count_and_validity() -> None:
    configs = list(olmo_core.configs(8))
    assert len(configs) == 90 + 14  # + the spellings OLMo-core resolves itself (option_configs)
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    assert {c.get("dp") for c in configs} == {None, "ddp", "fsdp", "hsdp"}
    assert any("ep" in c for c in configs) and any("expert_mesh_ep" in c for c in configs)
    for config in configs:
        olmo(8, **config)
    assert list(olmo_core.configs(1, dp_types=["ddp"], expert_mesh=False)) == [
        {},
        {"dp": "ddp"},
        {"dp": "ddp", "pp": 1, "cp": 1, "tp": 1},
    ]


def test_layouts_gives_olmo_cases() -> None:
    cases_ = meshsim.layouts(4, "olmo-core", dp_types=["hsdp"], expert_mesh=False)
    assert "olmo-core-4-dp=hsdp-num_replicas=2" in {c.id for c in cases_}


# -- properties ----------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(cases("olmo-core"))
def test_invariants_hold_for_every_config(case: tuple[int, dict[str, Any]]) -> None:
    world, config = case
    exp = olmo(world, **config)
    if config.get("dp") is None and world > 1:  # no DDP/FSDP: the finding above
        assert [v.check for v in find_violations(exp)] == ["gradient_reduce ⊇ data_parallel"]
    else:
        assert_invariants(exp)
    for getter in GETTERS:  # every getter is a kind, available or not
        assert getter in exp.kinds() or getter in exp.unavailable()


@st.composite
def degree_configs(draw: Any) -> tuple[int, dict[str, Any]]:
    """Random present/absent configs with small degrees (valid by construction)."""
    config: dict[str, Any] = {"dp": draw(st.sampled_from(["ddp", "fsdp", "hsdp"]))}
    world = 1
    for key in ("pp", "cp", "tp"):
        if draw(st.booleans()):
            config[key] = draw(st.integers(1, 3))
            world *= config[key]
    dp_world = draw(st.integers(1, 4))
    if config["dp"] == "hsdp":
        shard = draw(st.sampled_from([d for d in (1, 2, 3, 4) if dp_world % d == 0]))
        config["shard_degree"] = shard
        if "tp" not in config and draw(st.booleans()):
            config["ep"] = shard
    return world * dp_world, config


@settings(max_examples=150, deadline=None)
@given(degree_configs())
def test_sizes_match_olmos_own_test(case: tuple[int, dict[str, Any]]) -> None:
    world, config = case
    exp = olmo(world, **config)
    if config.get("dp") is None and world > 1:  # no DDP/FSDP: the finding above
        assert [v.check for v in find_violations(exp)] == ["gradient_reduce ⊇ data_parallel"]
    else:
        assert_invariants(exp)
    cp = config.get("cp") or 1
    dp_world = world // ((config.get("tp") or 1) * cp * (config.get("pp") or 1))
    assert exp.groups("get_dp_mesh").group_size == dp_world
    assert exp.groups("get_dp_process_group").group_size == dp_world
    assert exp.groups("get_dp_model_mesh").group_size == dp_world * cp
    for key in ("pp", "cp", "tp"):
        kind = exp.kind(f"get_{key}_mesh")
        assert kind.available == (key in config)
        if key in config:
            assert kind.groups().group_size == config[key]


@st.composite
def hsdp_degrees(draw: Any) -> dict[str, int]:
    return {k: draw(st.integers(1, 3)) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}


@settings(max_examples=100, deadline=None)
@given(hsdp_degrees())
def test_hsdp_cp_equals_legacy_torchtitan(d: dict[str, int]) -> None:
    world = d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"]
    exp = olmo(world, dp="hsdp", num_replicas=d["dp_replicate"], pp=d["pp"], cp=d["cp"], tp=d["tp"])
    titan = meshsim.expect("torchtitan", world, version="legacy", **d)
    shared = [(k, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
    shared += [
        ("get_dp_process_group", "dp"),
        ("get_dp_model_mesh", "dp_cp"),
        ("dp_cp", "dp_shard_cp"),
        ("get_tp_mesh", "tp"),
        ("get_pp_mesh", "pp"),
    ]
    assert_same_groups(exp, titan, shared)


@pytest.mark.parametrize(("degree", "shape"), [(1, (8, 1)), (4, (2, 4)), (8, (1, 8)), (-1, (1, 8))])
def test_expert_mesh_is_a_layout(degree: int, shape: tuple[int, int]) -> None:
    """``build_expert_parallel_mesh`` as a layout: dims (ep_replicate, ep_shard), row-major
    ranks, so its groups are the layout's own and its dims can be sliced like any mesh."""
    exp = meshsim.expect("olmo-core", 8, expert_mesh_ep=degree)
    mesh = exp.meshes["expert"]
    assert mesh == meshsim.Layout(ep_replicate=shape[0], ep_shard=shape[1])
    assert mesh.dim_names == ("ep_replicate", "ep_shard") and mesh.shape == shape
    assert exp.groups("expert:get_ep_mesh") == mesh.groups("ep_shard")
    assert exp.groups("ep_replicate") == mesh.groups("ep_replicate")
    assert set(exp.meshes) == {"expert"}
    assert dict(meshsim.expect("olmo-core", 8, dp="fsdp").meshes) == {}
