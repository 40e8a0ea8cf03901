"""DeepSpeed's own ``PipelineParallelGrid``, tied ``PipelineModule`` and MoE groups, on gloo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshsim import expect, layouts
from meshsim.checks import diff
from meshsim.harness import run
from meshsim.model.conventions.deepspeed import refused_configs
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    require,
)

pytestmark = [require("deepspeed", "deepspeed"), pytest.mark.requires_framework("deepspeed")]

BEFORE = "use_data_before_expert_parallel_"
ETP = "enable_expert_tensor_parallelism"
WORLD_4: list[dict[str, Any]] = [
    {},  # the grid's default: pipe 2 x data 2
    {"num_pp": 2, "num_dp": 2},
    {"num_pp": 2, "num_mp": 2},
    {"num_pp": 4, "num_mp": 1},
    {"num_mp": 2, "num_dp": 2, "ep": 2},
    {"num_mp": 2, "num_dp": 2, "ep": 2, ETP: True},
    {"num_mp": 1, "num_dp": 4, "ep": 2, BEFORE: True},
    {"num_mp": 1, "num_dp": 4, "ep": 4},
    {"axes": ["x", "y"], "dims": [2, 2]},
]
WORLD_8: list[dict[str, Any]] = [
    {},  # pipe 4 x data 2
    {"num_pp": 2, "num_mp": 2, "num_dp": 2},
    {"num_pp": 4, "num_mp": 2, "num_dp": 1},
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2},
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2, ETP: True},
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2, BEFORE: True},
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2, BEFORE: True, ETP: True},
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 4},  # default path: ep spans tp
    {"num_pp": 1, "num_mp": 2, "num_dp": 4, "ep": 4},
    {"num_pp": 1, "num_mp": 2, "num_dp": 4, "ep": 4, ETP: True},
    {"axes": ["pipe", "data", "model"], "dims": [2, 4, 1]},
    {"axes": ["pipe", "data", "seq"], "dims": [2, 4, 1]},  # size-1 extra axis: tied group ok
    {"axes": ["pipe", "data", "seq"], "dims": [2, 2, 2]},  # embedding unavailable (deadlock)
    {"axes": ["pipe", "data", "seq"], "dims": [1, 2, 4], "ep": 4},
    {"axes": ["x", "y"], "dims": [2, 4], "ep": 2},
    {"axes": ["pipe", "model"], "dims": [2, 4], "ep": 2, ETP: True},  # no grid: no mpu
    {"axes": ["pipe", "data"], "dims": [2, 4], "grid": False, "ep": 2},  # bare: pp ignored
    {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2, "mp_size": 2},  # AutoEP, TP-strided
    {"num_mp": 2, "num_dp": 4, "ep": 4, "mp_size": 2, "mp_mode": "sp"},
    {"num_pp": 2, "num_mp": 1, "num_dp": 4, "autotp_size": 4, "model_parallel_size": 2},
]
REFUSED: list[tuple[int, dict[str, Any]]] = [
    (8, {"num_pp": 3}),  # AssertionError "Invalid Grid"
    (4, {"num_pp": 2, "num_mp": 2, "num_dp": 2}),  # 8 ranks' topology on 4
    (4, {"axes": ["x", "x"], "dims": [2, 2]}),  # ValueError: namedtuple fields repeat
    (8, {"num_pp": 4, "num_mp": 1, "num_dp": 2, "ep": 4}),  # a stage's 2 ranks, ep 4
    (8, {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 4, ETP: True}),  # grid dp 2, ep 4
    (8, {"axes": ["pipe", "data", "seq"], "dims": [1, 2, 4], "ep": 4, ETP: True}),
    (4, {"axes": ["data", "model"], "dims": [2, 2], "grid": True}),  # AttributeError: .pipe
    (4, {"axes": ["pipe", "model"], "dims": [2, 2], "grid": True}),  # AttributeError: .data
    (4, {"num_mp": 2, "num_dp": 2, "ep": 2, "mp_size": 2, BEFORE: True}),  # NotImplementedError
    (4, {"model_parallel_size": 3, "num_pp": 4}),  # AssertionError: 4 is not divisible by 3
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("deepspeed", 4, config)


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("deepspeed", 8, config)


@pytest.mark.parametrize(("world", "config"), REFUSED, ids=case_id)
def test_refusals_match_reference(world: int, config: dict[str, Any]) -> None:
    assert_refused_alike("deepspeed", world, config)


def test_moe_example_world_8() -> None:
    """mp 2, dp 4, ep 2 on DeepSpeed's own MoE layer. Default: ``_create_expert_and_data_parallel``
    ignores tp, so EP groups are consecutive pairs (the TP pairs); with expert tensor
    parallelism, E + D strides the experts by tp inside each dense DP group."""
    config: dict[str, Any] = {"num_mp": 2, "num_dp": 4, "ep": 2}
    default = assert_matches("deepspeed", 8, config)
    assert [o.groups["expert"].members for o in default[:4]] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert default[0].groups["expert_data"].members == (0, 2, 4, 6)
    tensor = assert_matches("deepspeed", 8, {**config, ETP: True})
    assert tensor[0].groups["expert"].members == (0, 2)
    assert tensor[0].groups["expert_data"].members == (0, 4)


def _p2p(world: int, config: dict[str, Any]) -> list[tuple[int, ...]]:
    from meshsim.builders.real import deepspeed

    return deepspeed.p2p_groups(world, config)


@pytest.mark.parametrize("config", [{}, {"num_pp": 2, "num_mp": 2, "num_dp": 2}], ids=case_id)
def test_p2p_pairs_match_reference(config: dict[str, Any]) -> None:
    """``grid.p2p_groups`` ([rank, next stage], wrapping) equals the reference's ``p2p`` kind,
    row for row: row r is rank r's own pair."""
    pairs = run(_p2p, 8, backend="gloo", timeout=TIMEOUT, args=(8, config))[0]
    assert list(expect("deepspeed", 8, **config).groups("p2p").to_tuples()) == pairs
    assert [pair[0] for pair in pairs] == list(range(8))


def test_extra_axis_has_no_tied_embedding_group() -> None:
    """With a raw ("pipe", "data", "seq") topology the reference has ``embedding`` unavailable and
    the adapter records it absent without building the tied PipelineModule:
    ``_index_tied_modules`` only loops over data and model coordinates, so ranks of different
    ``seq`` coordinates would create different groups and deadlock."""
    config = {"axes": ["pipe", "data", "seq"], "dims": [2, 2, 2]}
    observations = assert_matches("deepspeed", 8, config)
    assert all("embedding" in o.absent for o in observations)
    assert "deadlock" in str(expect("deepspeed", 8, **config).unavailable()["embedding"])


def _default_moe_path(world: int, config: dict[str, Any]) -> Any:
    """``MoE(..., enable_expert_tensor_parallelism=False)`` (DeepSpeed's default): the layer
    calls ``groups._create_expert_and_data_parallel(ep)`` even when an mpu has tp > 1."""
    import importlib

    from meshsim.builders._common import collect
    from meshsim.builders.real import _shims, deepspeed

    _shims.load(*deepspeed._MODULES)
    topology = importlib.import_module("deepspeed.runtime.pipe.topology")
    with (
        _shims.unchanged_environ(),
        _shims.deepspeed_comm(),
        _shims.deepspeed_clean_moe_state() as groups,
    ):
        grid = topology.PipelineParallelGrid(topology=deepspeed.topology(world, config))
        groups.mpu = grid
        groups._create_expert_and_data_parallel(
            config["ep"], use_data_before_expert_parallel_=config.get(BEFORE, False)
        )
        name = f"ep_size_{config['ep']}"
        return collect(
            {
                "expert": groups._get_expert_parallel_group(name),
                "expert_data": groups._get_expert_data_parallel_group(name),
            }
        )


@pytest.mark.parametrize(
    "config",
    [
        {"num_mp": 2, "num_dp": 4, "ep": 2},
        {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 4},
        {"num_pp": 2, "num_mp": 2, "num_dp": 2, "ep": 2, BEFORE: True},
        {"num_mp": 1, "num_dp": 8, "ep": 2},
    ],
    ids=case_id,
)
def test_create_expert_and_data_parallel_is_the_default(config: dict[str, Any]) -> None:
    """``groups._create_expert_and_data_parallel(ep)`` called directly with the grid as mpu (the
    path of ``MoE(enable_expert_tensor_parallelism=False)``): the reference's default agrees."""
    observed = run(_default_moe_path, 8, backend="gloo", timeout=TIMEOUT, args=(8, config))
    assert diff(list(observed), expect("deepspeed", 8, **config)) is None


def test_build_leaves_environment_unchanged() -> None:
    """Keeps harness workers warm: a worker whose environment changed is replaced."""
    assert environment_changes("deepspeed", 4, {"num_pp": 2, "num_mp": 2, "ep": 1}) == []


def _comm_backend_state() -> tuple[bool, bool]:
    import importlib

    from meshsim.builders.real import _shims

    _shims.load("deepspeed.comm.comm", "deepspeed.comm.torch")
    with _shims.deepspeed_comm() as ds_comm:
        without_shm_op = ds_comm.cdb.shm_comm_op is None and ds_comm.is_initialized()
    return without_shm_op, importlib.import_module("deepspeed.comm.comm").cdb is None


def test_comm_backend_skips_the_shm_op_and_is_reset() -> None:
    """``deepspeed.comm`` works on the harness's group without compiling the shm op."""
    assert run(_comm_backend_state, 2, backend="gloo", timeout=TIMEOUT) == [(True, True)] * 2


def test_moe_groups_are_rebuilt_per_build() -> None:
    """Same ep, different topologies, one warm world: the MoE group cache is cleared."""
    assert_matches("deepspeed", 4, {"num_mp": 2, "num_dp": 2, "ep": 2})
    assert_matches("deepspeed", 4, {"num_mp": 1, "num_dp": 4, "ep": 2})


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(4, "deepspeed") + layouts(8, "deepspeed"), ids=case_id)
def test_every_config_matches_reference(case: Any) -> None:
    assert_matches("deepspeed", case.world_size, case.config)


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(16, "deepspeed"), ids=case_id)
def test_every_config_matches_reference_world_16(case: Any) -> None:
    assert_matches("deepspeed", 16, case.config)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "config"),
    [(w, c) for w in (8, 16) for c in refused_configs(w)],
    ids=case_id,
)
def test_every_listed_refusal_is_reproduced(world: int, config: dict[str, Any]) -> None:
    assert_refused_alike("deepspeed", world, config)


def _topologies() -> list[tuple[list[str], list[int]]]:
    """Every topology the sweeps at 8 and 16 use, plus raw ones with extra axes."""
    seen = {
        (tuple(e.config["axes"]), tuple(e.config["dims"]))
        for w in (8, 16)
        for e in (expect("deepspeed", w, **c.config) for c in layouts(w, "deepspeed"))
    }
    seen |= {(("pipe", "data", "seq", "model"), (2, 2, 2, 2)), (("x", "y"), (4, 4))}
    return [(list(a), list(d)) for a, d in sorted(seen)]


def test_rank_repr_and_comm_lists_equal_deepspeed_process_topology() -> None:
    """``get_rank_repr`` (default and custom omit/separators), ``get_axis_comm_lists`` of every
    axis and of unknown ones (DeepSpeed: ``[]``) and ``get_dim`` (0 when unknown), against
    DeepSpeed's own ``ProcessTopology`` for every topology the sweeps list at 8 and 16."""
    from meshsim.builders.real import _shims
    from meshsim.model.conventions.deepspeed import ProcessTopology

    (topo_module,) = _shims.load("deepspeed.runtime.pipe.topology")
    topologies = _topologies()
    assert len(topologies) > 30
    for axes, dims in topologies:
        real, ours = topo_module.ProcessTopology(axes, dims), ProcessTopology(axes, dims)
        for axis in [*axes, "pipe", "data", "model", "expert", "nope"]:
            assert ours.get_axis_comm_lists(axis) == real.get_axis_comm_lists(axis), (axes, axis)
            assert ours.get_dim(axis) == real.get_dim(axis)
        for rank in range(real.world_size()):
            assert ours.get_rank_repr(rank) == real.get_rank_repr(rank)
            custom = {"omit_axes": ["model"], "inner_sep": "+", "outer_sep": "/"}
            assert ours.get_rank_repr(rank, **custom) == real.get_rank_repr(rank, **custom)
    assert ProcessTopology(["pipe", "data"], [2, 4]).get_axis_comm_lists("model") == []


def test_partition_parts_equal_deepspeed_partitioners() -> None:
    """``partition_parts`` against DeepSpeed's ``partition_uniform`` / ``partition_balanced``
    (what ``PipelineModule`` calls for ``"uniform"`` / ``"parameters"``), on many weight lists."""
    import random

    from meshsim.builders.real import _shims
    from meshsim.model.conventions.deepspeed import partition_parts

    (utils,) = _shims.load("deepspeed.runtime.utils")
    rng = random.Random(9)
    for _ in range(300):
        stages = rng.randint(1, 6)
        weights = [rng.choice([0, 1, 2, 5, 17, 100]) for _ in range(rng.randint(1, 12))]
        balanced = [int(p) for p in utils.partition_balanced(weights=weights, num_parts=stages)]
        assert partition_parts(stages, weights, "parameters") == balanced, (stages, weights)
        uniform = utils.partition_uniform(num_items=len(weights), num_parts=stages)
        assert partition_parts(stages, weights, "uniform") == uniform


def _module_parts(world: int, method: str, widths: list[int]) -> list[int]:
    """``PipelineModule.parts`` of a stack of ``Linear(w, w)`` layers (parameters w*w + w)."""
    import torch

    from meshsim.builders.real import _shims

    (topo_module, pipe_module) = _shims.load(
        "deepspeed.runtime.pipe.topology", "deepspeed.runtime.pipe.module"
    )
    with _shims.unchanged_environ(), _shims.deepspeed_comm():
        topo = topo_module.PipeDataParallelTopology(num_pp=world, num_dp=1)
        layers = [pipe_module.LayerSpec(torch.nn.Linear, w, w) for w in widths]
        module = pipe_module.PipelineModule(layers=layers, topology=topo, partition_method=method)
        return [int(p) for p in module.parts]


@pytest.mark.parametrize("method", ["uniform", "parameters"])
def test_pipeline_module_parts_match_reference(method: str) -> None:
    """A live ``PipelineModule`` on 4 gloo ranks: every rank's ``parts`` is the reference's."""
    from meshsim.model.conventions.deepspeed import partition_parts

    widths = [8, 1, 1, 1, 4, 4, 2, 1, 1, 6]
    parts = run(_module_parts, 4, backend="gloo", timeout=TIMEOUT, args=(4, method, widths))
    assert parts == [partition_parts(4, [w * w + w for w in widths], method)] * 4


def test_sweep_real_runs_every_layout_through_deepspeed(tmp_path: Path) -> None:
    """``meshsim sweep --real --framework deepspeed``: the documented CI entry point for a
    framework, every valid layout built by DeepSpeed's own code on gloo (its default tier),
    each on every rank: with --real no layout is moved to the fake tier for repeating
    another's groups (the fake tier cannot observe every adapter: accelerate's data-loading
    peers are found by communicating)."""
    from tests.cli.helpers import run_cli

    report = tmp_path / "sweep.json"
    result = run_cli(
        "sweep", "--real", "--framework", "deepspeed", "-n", "4", "--json", str(report)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert data["real"] is True and data["tiers"] == ["gloo"]
    assert data["layouts_done"] == len(layouts(4, "deepspeed")) == data["passed"]
    assert all(list(r["tiers"]) == ["gloo"] for r in data["results"])
    assert all(r["shares_groups_with"] is None for r in data["results"])
    assert all(r["tiers"]["gloo"]["ranks"] is None for r in data["results"])
    results = [t for r in data["results"] for t in r["tiers"].values()]
    assert all(t["real"] and t["kinds_skipped"] == {} for t in results)
