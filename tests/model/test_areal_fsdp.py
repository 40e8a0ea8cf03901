"""AReaL FSDP convention (``ParallelHelper.build_mesh``): hand-checked groups, roles, refusals."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import areal_fsdp
from meshsim.model.invariants import find_violations


def fsdp(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("areal-fsdp", world, **config)


def dims(exp: meshsim.Expected) -> dict[str, int]:
    assert exp.layout is not None
    return dict(zip(exp.layout.root_names, exp.layout.root_shape))


def test_size_one_dims_are_kept_and_flattened() -> None:
    exp = fsdp(4, data_parallel_size=4)
    assert dims(exp) == {"dp": 4, "sp": 1, "tp": 1}
    assert list(exp.kinds()) == ["dp", "sp", "tp", "dp_sp", "sp_tp"]
    assert exp.groups("dp") == exp.groups("dp_sp") == [(0, 1, 2, 3)]
    assert exp.groups("sp_tp") == [(0,), (1,), (2,), (3,)]


def test_dp_sp_tp_groups() -> None:
    exp = fsdp(8, data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2)
    assert exp.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("sp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("dp_sp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("sp_tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert dict(exp.roles) == {
        "data_parallel": "dp",
        "gradient_reduce": "dp_sp",
        "loss": "dp",
        "tensor": "tp",
        "context": "sp",
    }


def test_ep_with_etp_1_borrows_sp_and_tp() -> None:
    exp = fsdp(8, data_parallel_size=4, tensor_parallel_size=2, expert_parallel_size=4)
    # dp_mod_ep = 4 * 2 / 4 = 2, dp_in_ep = 4 / 2 = 2
    assert dims(exp) == {"dp_mod_ep": 2, "dp_in_ep": 2, "sp": 1, "tp": 2}
    assert exp.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("dp_mod_ep") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.roles["expert"] == "ep" and exp.roles["expert_data"] == "dp_mod_ep"


def test_ep_with_etp_tp_leaves_tp_out() -> None:
    exp = fsdp(
        8,
        data_parallel_size=4,
        tensor_parallel_size=2,
        expert_parallel_size=2,
        expert_tensor_parallel_size=2,
    )
    assert dims(exp) == {"dp_mod_ep": 2, "dp_in_ep": 2, "sp": 1, "tp": 2}
    assert exp.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("dp_sp") == exp.groups("dp")


def test_every_sweep_config_holds_the_invariants() -> None:
    configs = list(areal_fsdp.configs(8))
    assert len(configs) == 36
    for config in configs:
        assert find_violations(fsdp(8, **config)) == [], config


@pytest.mark.parametrize(
    ("config", "upstream", "words"),
    [
        ({"data_parallel_size": 2, "pipeline_parallel_size": 2}, "AssertionError", "Pipeline"),
        ({"data_parallel_size": 4, "tensor_parallel_size": 0}, "AssertionError", ">= 1"),
        ({"data_parallel_size": 4, "expert_parallel_size": 8}, "AssertionError", "cannot divide"),
        (
            {
                "tensor_parallel_size": 4,
                "expert_parallel_size": 2,
                "expert_tensor_parallel_size": 2,
            },
            "AssertionError",
            "ETP=TP or ETP=1",
        ),
        (
            {"tensor_parallel_size": 4, "expert_parallel_size": 2},
            "AssertionError",
            "multiple of sp x tp",
        ),
        ({"data_parallel_size": 8}, "RuntimeError", "bigger"),
        ({"data_parallel_size": 2}, "IndexError", "ranks 0-1 only"),
        ({"data_parallel_size": 0, "tensor_parallel_size": 4}, "AssertionError", ">= 1"),
    ],
)
def test_refusals_name_areal_exception_types(
    config: dict[str, Any], upstream: str, words: str
) -> None:
    with pytest.raises(LayoutError, match=words) as refused:
        fsdp(4, **config)
    assert refused.value.upstream == upstream


def test_listed_refusals_are_refused() -> None:
    for config in areal_fsdp.refused_configs(8):
        with pytest.raises(LayoutError):
            fsdp(8, **config)


def test_unknown_key_names_the_close_one() -> None:
    with pytest.raises(LayoutError, match="data_parallel_size"):
        fsdp(4, data_parallel=4)


def test_a_million_ranks_is_lazy() -> None:
    exp = fsdp(2**20, data_parallel_size=2**16, context_parallel_size=4, tensor_parallel_size=4)
    assert exp.group_of(2**20 - 1, "sp_tp") == tuple(range(2**20 - 16, 2**20))
