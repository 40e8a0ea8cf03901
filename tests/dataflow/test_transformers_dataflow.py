"""The transformers data-flow recipe: two meshes, one job. The model is sharded on transformers'
own mesh (FSDP2 over ``("dp_replicate", "fsdp")`` or ``"fsdp"``, TP over ``"tp"``); the
Trainer's loader splits batches over the accelerate mesh it builds for a TP model. The right
wiring passes, each wrong one that differs from it is caught."""

from __future__ import annotations

import importlib.util

import pytest

from meshsim.dataflow.recipes import check_dataflow
from meshsim.errors import UsageError

TP_FSDP = {"tp_size": 2, "fsdp_size": 2}


@pytest.mark.parametrize(
    ("world", "config"),
    [(4, TP_FSDP), (8, {**TP_FSDP, "dp_replicate_size": 2}), (4, {"tp_size": 4})],
    ids=str,
)
def test_the_model_mesh_and_the_trainers_loader_agree(world: int, config: dict) -> None:
    result = check_dataflow("transformers", world, "threaded", **config)
    assert result.passed, str(result)


def test_tp_peers_seeded_apart_are_caught() -> None:
    result = check_dataflow("transformers", 4, "threaded", wiring="tp_different_seeds", **TP_FSDP)
    assert not result.passed and result.error is None, str(result)
    assert "ranks 0 and 1 are TP peers" in (result.data_error or ""), str(result)


def test_without_tp_the_trainer_builds_no_mesh_and_a_missing_wrapper_is_caught() -> None:
    """No TP: the Trainer makes no ParallelismConfig, every rank is a loader replica; the
    data mesh is then none, so wrapping the model over it leaves gradients unreduced."""
    assert check_dataflow("transformers", 4, "threaded", fsdp_size=4).passed
    result = check_dataflow("transformers", 4, "threaded", wiring="wrapper_over_data_mesh",
                            fsdp_size=4)  # fmt: skip
    assert not result.passed and result.error is None, str(result)
    assert "ended with different gradients" in (result.gradient_error or ""), str(result)


def test_pipeline_stages_load_as_the_released_trainer_does() -> None:
    """``pp_size=4`` at world 4: no TP, no accelerate mesh, so rank r loads as index r of 4
    (the reference's data-parallel kind is the Trainer's loader, not the model's fsdp dim)."""
    result = check_dataflow("transformers", 4, "threaded", pp_size=4)
    assert result.passed, str(result)


@pytest.mark.parametrize(
    ("config", "reason"),
    [({"pp_size": 2, "tp_size": 2}, "no Trainer runs"), ({}, "every transformers size")],
    ids=str,
)
def test_layouts_the_recipe_does_not_train_are_refused_before_any_rank_runs(
    config: dict, reason: str
) -> None:
    with pytest.raises(UsageError, match=reason):
        check_dataflow("transformers", 4, "threaded", **config)


@pytest.mark.requires_framework("transformers")
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="needs transformers and accelerate",
)
def test_real_transformers_and_trainer_wiring_passes_on_gloo() -> None:
    result = check_dataflow("transformers", 4, "gloo", real=True, **TP_FSDP)
    assert result.passed, str(result)
