"""DeepSpeed AutoEP + AutoTP folding convention: hand-checked tables, roles, refusals, and
DeepSpeed's own ``expected_folding_group_tables`` for every config of world 8 and 16."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import deepspeed_autoep

FW = "deepspeed-autoep"
KINDS = ("tp", "dense_dp", "ep", "edp")


def autoep(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect(FW, world, **config)


def tables(exp: meshsim.Expected) -> dict[str, list[tuple[int, ...]]]:
    return {k: [tuple(g) for g in exp.groups(k)] for k in exp.kinds()}


# -- hand-checked examples -----------------------------------------------------------------------
def test_tp2_ep4_world8() -> None:
    exp = autoep(8, tp_size=2, ep_size=4)
    assert tables(exp) == {
        "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "dense_dp": [(0, 2, 4, 6), (1, 3, 5, 7)],
        "ep": [(0, 1, 2, 3), (4, 5, 6, 7)],
        "edp": [(0, 4), (1, 5), (2, 6), (3, 7)],
    }
    assert dict(exp.roles) == {
        "data_parallel": "dense_dp",
        "gradient_reduce": "dense_dp",
        "tensor": "tp",
        "expert": "ep",
        "expert_data": "edp",
    }


def test_cross_lane_ep_puts_tp_peers_in_one_edp_group() -> None:
    """tp 4, ep 2: EP runs of 2 cut each TP group in half, so TP peers 0 and 2 (same tokens)
    reduce expert gradients together: they routed disjoint token slices."""
    exp = autoep(8, tp_size=4, ep_size=2)
    assert exp.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("dense_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("edp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.group_of(2, "edp") == (0, 2, 4, 6)
    assert exp.group_of(2, "tensor") == (0, 1, 2, 3)


def test_ep_equal_to_tp_makes_ep_groups_the_tp_groups() -> None:
    exp = autoep(8, tp_size=2, ep_size=2, mp_mode="tp")
    assert exp.groups("ep") == exp.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("edp") == exp.groups("dense_dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_pipeline_stages_fold_separately_without_tp() -> None:
    exp = autoep(8, pp_size=2, ep_size=2)
    assert exp.groups("dense_dp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("edp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.meshes["expert"].dim_names == ("pp", "edp", "ep")
    assert exp.layout is not None and exp.layout.shape == (2, 4, 1)


def test_tp_1_builds_no_tp_group() -> None:
    exp = autoep(4)
    assert "tp" in exp.unavailable() and "tensor" not in exp.roles
    assert "autotp_size > 1" in str(exp.unavailable()["tp"])
    assert tables(exp) == {"dense_dp": [(0, 1, 2, 3)], "ep": [(0,), (1,), (2,), (3,)],
                           "edp": [(0, 1, 2, 3)]}  # fmt: skip
    assert dict(exp.config) == {"pp_size": 1, "tp_size": 1, "ep_size": 1, "etp_size": 1,
                                "mp_mode": "tp"}  # fmt: skip


def test_autotp_size_below_1_is_no_autotp_as_the_engine_clamps_it() -> None:
    """tensor_parallel.autotp_size defaults to 0 in DeepSpeed; the engine passes
    max(autotp_size, 1), so 0 (or -1) folds exactly as 1 instead of being refused."""
    for tp in (0, -1):
        exp = autoep(8, tp_size=tp, ep_size=2)
        assert tables(exp) == tables(autoep(8, tp_size=1, ep_size=2))
        assert exp.config["tp_size"] == 1


def test_mp_mode_never_changes_groups() -> None:
    assert tables(autoep(8, tp_size=2, ep_size=4, mp_mode="sp")) == tables(
        autoep(8, tp_size=2, ep_size=4, mp_mode="tp")
    )


def test_million_ranks_answer_per_rank_queries() -> None:
    exp = autoep(1 << 20, tp_size=8, ep_size=64)
    rank = 123_457
    assert exp.group_of(rank, "tp") == tuple(range(123_456, 123_464))
    assert exp.group_of(rank, "ep")[0] == rank - rank % 64
    edp = exp.group_of(rank, "edp")
    assert edp is not None and len(edp) == (1 << 20) // 64 and edp[1] - edp[0] == 64


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", list(deepspeed_autoep.refused_configs(8)), ids=str)
def test_refused_configs_raise_value_error(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as refused:
        autoep(8, **config)
    assert refused.value.upstream == "ValueError"


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"pp_size": 3}, "pp_size=3 must divide world_size=8"),
        ({"pp_size": 2, "tp_size": 8}, "autotp_size=8 must divide the stage size 4"),
        ({"pp_size": 2, "ep_size": 8}, "(8 * 1) must divide the stage size 4"),
        ({"ep_size": 4, "etp_size": 4}, "(4 * 4) must divide"),
        ({"tp_size": 2, "pp_size": 2, "ep_size": 2}, "pp_size=1 only"),
        ({"ep_size": 2, "etp_size": 2}, "expert_tensor_parallel_size=2"),
        ({"tp_size": 2}, "autoep_size > 1"),
        ({"ep_size": np.int64(2)}, "positive integer"),
        ({"ep_size": 2.0}, "positive integer"),
    ],
)
def test_refusal_says_which_check(config: dict[str, Any], words: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(words)):
        autoep(8, **config)


def test_bool_sizes_pass_as_deepspeed_lets_them() -> None:
    assert tables(autoep(4, ep_size=True)) == tables(autoep(4, ep_size=1))


def test_unknown_key_names_the_close_one() -> None:
    with pytest.raises(LayoutError, match="'ep_size' for 'ep_sizes'"):
        autoep(8, ep_sizes=2)


# -- sweep ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 6, 8, 16])
def test_configs_are_distinct_and_accepted(world: int) -> None:
    found = [tuple(sorted(c.items())) for c in deepspeed_autoep.configs(world)]
    assert len(found) == len(set(found))
    for config in deepspeed_autoep.configs(world):
        exp = autoep(world, **config)
        for kind in exp.kinds():
            ranks = sorted(r for g in exp.groups(kind) for r in g)
            assert ranks == list(range(world)), (config, kind)
    assert len(list(deepspeed_autoep.configs(8))) == 19


def test_importing_the_reference_imports_no_torch() -> None:
    code = "import sys, meshsim.model.conventions.deepspeed_autoep; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# -- DeepSpeed's own tables ----------------------------------------------------------------------
def _upstream(world: int, config: dict[str, Any]) -> Any:
    """DeepSpeed's spec for ``config`` after both of the engine's checks (raises as they do).
    The engine hands build_folding_spec ``max(autotp_size, 1)`` (runtime/engine.py and
    module_inject/auto_ep_config.py in 0.19.8), so AutoTP's default 0 is no AutoTP."""
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    spec = folding.build_folding_spec(
        world_size=world,
        pp_size=config.get("pp_size", 1),
        tp_size=max(config.get("tp_size", 1), 1),
        ep_size=config.get("ep_size", 1),
        etp_size=config.get("etp_size", 1),
        mp_mode=config.get("mp_mode", "tp"),
    )
    folding.validate_folding_global(spec)
    return spec


@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("world", [8, 16])
def test_every_config_equals_expected_folding_group_tables(world: int) -> None:
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    for config in deepspeed_autoep.configs(world):
        ours = autoep(world, **config)
        theirs = folding.expected_folding_group_tables(_upstream(world, config))
        for kind in KINDS:
            want = [tuple(g) for g in getattr(theirs, f"{kind}_groups")]
            if kind == "tp" and config["tp_size"] == 1:
                assert want == [(r,) for r in range(world)] and "tp" in ours.unavailable()
                continue
            assert [tuple(g) for g in ours.groups(kind)] == want, (config, kind)
        for rank in (0, world - 1):
            local = folding.local_folding_ranks(rank, _upstream(world, config))
            assert ours.group_of(rank, "expert") == local["ep"]
            assert ours.group_of(rank, "expert_data") == local["edp"]
            assert ours.group_of(rank, "data_parallel") == local["dense_dp"]


@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("world", [8, 12])
def test_accepts_exactly_what_deepspeed_accepts(world: int) -> None:
    """Every size 0..world+1 (pp, tp, ep) and etp 1..3: both accept, or both raise ValueError."""
    pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    sizes = range(0, world + 2)
    for pp in sizes:
        for tp in sizes:
            for ep in sizes:
                for etp in (1, 2, 3):
                    config = {"pp_size": pp, "tp_size": tp, "ep_size": ep, "etp_size": etp}
                    try:
                        _upstream(world, config)
                    except ValueError:
                        with pytest.raises(LayoutError) as refused:
                            autoep(world, **config)
                        assert refused.value.upstream == "ValueError"
                    else:
                        autoep(world, **config)


@pytest.mark.requires_framework("deepspeed")
def test_refused_configs_are_refused_by_deepspeed() -> None:
    pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    for world in (8, 16):
        for config in deepspeed_autoep.refused_configs(world):
            with pytest.raises(ValueError):
                _upstream(world, config)


@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("world", [8, 16])
def test_roles_follow_the_gradient_reduction_strategy(world: int) -> None:
    """Dense parameters AVERAGE over TP (identical replicas: no data is summed there) and so
    reduce over dense_dp; routed experts (``allreduce=False``) skip TP (only ``/tp_size``) and
    reduce over edp; TP-sharded parameters are the TP path's. Without AutoTP nothing folds."""
    torch = pytest.importorskip("torch")
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    dense, expert, sharded = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    expert.allreduce = False  # what DeepSpeed's MoE experts carry
    sharded.tensor_model_parallel = True
    for config in deepspeed_autoep.configs(world):
        spec = _upstream(world, config)
        strategies = [
            folding.autoep_folding_gradient_reduction_strategy(spec, p)
            for p in (dense, expert, sharded)
        ]
        roles = autoep(world, **config).roles
        if config["tp_size"] > 1:
            assert strategies == ["average", "expert_tp_cancel", "skip"], config
            assert roles["tensor"] == "tp" and roles["gradient_reduce"] == "dense_dp"
        else:
            assert strategies == ["skip"] * 3, config
            assert "tensor" not in roles
        assert roles["expert_data"] == "edp" and roles["data_parallel"] == "dense_dp"


@pytest.mark.requires_framework("deepspeed")
def test_finding_etp_changes_the_spec_but_not_the_tables() -> None:
    """build_folding_spec accepts etp 2 and counts edp = stage / (ep * etp) = 1 at world 4,
    ep 2, but expected_folding_group_tables ignores etp: its EDP groups hold 2 ranks. The
    engine refuses etp != 1 next (validate_folding_global), so no group is ever built."""
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    spec = folding.build_folding_spec(world_size=4, pp_size=1, tp_size=1, ep_size=2, etp_size=2)
    assert spec.edp_size == 1
    assert folding.expected_folding_group_tables(spec).edp_groups == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        folding.validate_folding_global(spec)
    with pytest.raises(LayoutError):
        autoep(4, ep_size=2, etp_size=2)
