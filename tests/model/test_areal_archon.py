"""AReaL Archon convention (``ArchonParallelDims``): hand-checked groups, roles, refusals."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import areal_archon
from meshsim.model.invariants import find_violations


def archon(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("areal-archon", world, **config)


def dims(exp: meshsim.Expected) -> dict[str, int]:
    assert exp.layout is not None
    return dict(zip(exp.layout.root_names, exp.layout.root_shape))


def test_defaults_infer_dp_shard_and_keep_size_one_dims() -> None:
    exp = archon(4)
    assert dims(exp) == {"pp": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    assert list(exp.kinds()) == [
        "pp", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "pp_cp_tp",
    ]  # fmt: skip
    assert exp.groups("dp") == exp.groups("dp_shard_cp") == [(0, 1, 2, 3)]
    assert exp.groups("pp_cp_tp") == [(0,), (1,), (2,), (3,)]
    assert exp.config["dp_shard"] == 4


def test_pp_cp_tp_groups_and_roles() -> None:
    exp = archon(8, pp=2, cp=2, tp=2)
    assert dims(exp) == {"pp": 2, "dp_shard": 1, "cp": 2, "tp": 2}
    assert exp.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("dp") == [(i,) for i in range(8)]
    assert exp.groups("dp_shard_cp") == exp.groups("dp_cp") == exp.groups("cp")
    assert exp.groups("pp_cp_tp") == [tuple(range(8))]
    assert dict(exp.roles) == {
        "data_parallel": "dp",
        "gradient_reduce": "dp_shard_cp",
        "loss": "dp",
        "tensor": "tp",
        "context": "cp",
        "pipeline": "pp",
    }


def test_ep_with_etp_1_takes_tp_and_has_no_ep_tp() -> None:
    exp = archon(8, tp=2, ep=4)
    # dp_shard 4: dp_shard_mod_ep = 4 * 2 / 4 = 2, dp_shard_in_ep = 4 / 2 = 2
    assert dims(exp) == {"pp": 1, "dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "cp": 1, "tp": 2}
    assert exp.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert "ep_tp" not in exp.kinds() and "dp_shard" not in exp.kinds()
    assert exp.roles["expert"] == "ep" and exp.roles["expert_data"] == "dp_shard_mod_ep"


def test_ep_with_etp_tp_has_the_2d_ep_tp_mesh() -> None:
    exp = archon(8, cp=2, tp=2, ep=2, etp=2)
    assert dims(exp) == {"pp": 1, "dp_shard_mod_ep": 2, "dp_shard_in_ep": 1, "cp": 2, "tp": 2}
    assert exp.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]  # dp_shard_in_ep x cp
    kind = exp.kind("ep_tp")
    assert kind.mesh_dims == ("ep", "tp") and kind.mesh_shape == (2, 2)
    assert exp.groups("ep_tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_dp_replicate_is_accepted_and_ignored() -> None:
    assert archon(8, dp_replicate=2).layout == archon(8).layout


def test_every_sweep_config_holds_the_invariants() -> None:
    configs = list(areal_archon.configs(8))
    assert len(configs) == 64  # 61 with dp_shard inferred, 3 with it given
    for config in configs:
        assert find_violations(archon(8, **config)) == [], config


@pytest.mark.parametrize(
    ("config", "upstream", "words"),
    [
        ({"dp_shard": 4, "tp": 4}, "ValueError", "must equal world_size"),
        ({"tp": 3}, "ValueError", "2 \\* 3 \\* 1 \\* 1 = 6"),  # 8 // 3 floors to 2
        ({"tp": 0}, "ZeroDivisionError", "division by zero"),
        ({"etp": 2}, "ValueError", "etp must be 1 or equal to tp"),
        ({"cp": 2, "ep": 3}, "ValueError", "When etp=tp, ep must be divisible by cp"),
        ({"tp": 4, "ep": 2}, "ValueError", "When etp=1, ep must be divisible by cp \\* tp"),
        ({"ep": 16}, "ValueError", "dp_shard \\* cp must be divisible by ep"),
    ],
)
def test_refusals_are_value_errors(config: dict[str, Any], upstream: str, words: str) -> None:
    with pytest.raises(LayoutError, match=words) as refused:
        archon(8, **config)
    assert refused.value.upstream == upstream


def test_listed_refusals_are_refused() -> None:
    for config in areal_archon.refused_configs(8):
        with pytest.raises(LayoutError):
            archon(8, **config)


def test_a_million_ranks_is_lazy() -> None:
    exp = archon(2**20, pp=4, cp=4, tp=8, ep=64)
    assert exp.group_of(0, "pp_cp_tp") == tuple(
        p * 2**18 + c * 8 + t for p in range(4) for c in range(4) for t in range(8)
    )


def test_data_parallel_group_leaves_cp_shards_out_of_the_fsdp_mesh() -> None:
    """ArchonEngine clips gradients with ``fsdp_group=data_parallel_group`` ('dp'), while
    ``apply_fsdp`` shards over ``dp_shard_cp``: with cp > 1 the norm's all-reduce misses the
    shards the other cp ranks hold (the FSDP engine uses its ``dp_sp`` mesh for both)."""
    exp = archon(2, cp=2)
    assert exp.groups("dp") == [(0,), (1,)]
    assert exp.groups("dp_shard_cp") == [(0, 1)]
