"""The accelerate data-flow recipe: FSDP2 over ``mesh[fsdp_dim_names]``, the loader's index from
``prepare_data_loader``'s arithmetic; the right wiring passes, each wrong one is caught."""

from __future__ import annotations

import importlib.util

import pytest

from meshsim.dataflow.recipes import check_dataflow

LAYOUT = {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}
CAUGHT = {
    "sampler_over_gradient_mesh": ("data_error", "ranks 0 and 2 are CP peers"),
    "wrapper_over_data_mesh": ("gradient_error", "CP peers 0 and 2 share gradient group"),
    "tp_different_seeds": ("data_error", "ranks 0 and 1 are TP peers"),
}


def test_the_right_wiring_passes() -> None:
    result = check_dataflow("accelerate", 8, "threaded", **LAYOUT)
    assert result.passed, str(result)


@pytest.mark.parametrize("wiring", list(CAUGHT))
def test_each_wrong_wiring_is_caught(wiring: str) -> None:
    result = check_dataflow("accelerate", 8, "threaded", wiring=wiring, **LAYOUT)
    field, phrase = CAUGHT[wiring]
    assert not result.passed and result.error is None, str(result)
    assert phrase in (getattr(result, field) or ""), str(result)


def test_hsdp_with_cp_and_ddp_pass() -> None:
    for config in ({"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2},
                   {"dp_replicate_size": 4}):  # fmt: skip
        result = check_dataflow("accelerate", 4 if len(config) == 1 else 8, "threaded", **config)
        assert result.passed, str(result)


def test_deepspeed_has_no_recipe() -> None:
    """Each rank refuses (DeepSpeed wraps the model itself), reported as the run's error."""
    result = check_dataflow(
        "accelerate", 4, "threaded", dp_shard_size=4, distributed_type="DEEPSPEED"
    )
    assert not result.passed and "UsageError" in (result.error or ""), str(result)
    assert "not DeepSpeed" in (result.error or "")


@pytest.mark.slow
@pytest.mark.requires_framework("accelerate")
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_real_accelerate_wiring_passes_on_gloo() -> None:
    result = check_dataflow("accelerate", 8, "gloo", real=True, **LAYOUT)
    assert result.passed, str(result)
