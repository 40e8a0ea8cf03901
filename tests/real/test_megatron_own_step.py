"""megatron-core 0.16.1's own training step against its serial twin (``meshsim.own_steps``).

The step is megatron's: its ``GPTModel`` (local layer spec), ``DistributedDataParallel``,
forward-backward schedule with ``finalize_model_grads``, ``get_megatron_optimizer`` with
gradient clipping, on gloo ranks. Passing layouts must pass; bugs planted in megatron's own
functions (through the step's ``before`` hook, inside every rank; each returns its undo, so a
warm gloo worker does not keep it) must fail, naming the parameter and the likely mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from meshsim.errors import SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("megatron", "megatron.core"), pytest.mark.requires_framework("megatron")]

TIMEOUT = 600.0  # a hang guard: two loaded cores importing megatron in three processes
TP = {"tensor_model_parallel_size": 2}
EP = {"expert_model_parallel_size": 2}


def _run(config: dict[str, Any], before: Any = None, **options: Any) -> Any:
    from meshsim.own_steps import megatron as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before, **options), 2, "megatron", backend="gloo",
        batch=own.batch, timeout=TIMEOUT, **config,
    )  # fmt: skip


def test_tensor_parallel_with_sequence_parallelism_matches_its_serial_twin() -> None:
    """The CLI's path: tp=2 runs with sequence parallelism, megatron's plain optimizer."""
    result = check_equivalence("megatron", 2, "gloo", real=True, timeout=TIMEOUT, **TP)
    assert result.passed, result.error
    assert "get_megatron_optimizer" in result.step
    assert "288 tensors over 2 steps" in result.summary


@pytest.mark.parametrize(
    ("config", "options"),
    [
        ({}, {"distributed_optimizer": True}),
        pytest.param(EP, {}, marks=pytest.mark.slow),
        pytest.param(TP, {"sequence_parallel": False}, marks=pytest.mark.slow),
        pytest.param({"pipeline_model_parallel_size": 2}, {}, marks=pytest.mark.slow),
    ],
    ids=["dp+distributed-optimizer", "ep (MoE)", "tp without sp", "pp"],
)
def test_megatrons_own_step_matches_its_serial_twin(
    config: dict[str, Any], options: dict[str, Any]
) -> None:
    assert "matches the serial step" in str(_run(config, **options))


def _first_line(planted: Callable[[], Any], config: dict[str, Any]) -> str:
    with pytest.raises(SerialMismatch) as info:
        _run(config, before=planted)
    return str(info.value).splitlines()[0]


def _no_sequence_parallel_all_reduce() -> Callable[[], None]:
    """``finalize_model_grads`` without its all-reduce over tp of the gradients of weights
    replicated over tp under sequence parallelism (norms, row-parallel biases): each tp rank
    keeps the partial gradient of its sequence shard."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = finalize._allreduce_non_tensor_model_parallel_grads
    finalize._allreduce_non_tensor_model_parallel_grads = lambda *args, **kwargs: None

    def undo() -> None:
        finalize._allreduce_non_tensor_model_parallel_grads = original

    return undo


def test_a_missing_sequence_parallel_all_reduce_is_named() -> None:
    first = _first_line(_no_sequence_parallel_all_reduce, TP)
    assert first.startswith("grad of `decoder.layers.0.input_layernorm.weight` at step 1"), first
    assert "the sum over tp (2 ranks, the tensor group) is the serial value" in first, first
    assert "under sequence parallelism a weight replicated over tp" in first, first


def _expert_grads_over_the_dense_group() -> Callable[[], None]:
    """megatron's DDP handed the dense data-parallel group for its expert-parameter buffers:
    under ep, ranks holding different experts average their experts' gradients."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    original = ProcessGroupCollection.__dict__["setup_process_groups_for_ddp"]

    def setup_process_groups_for_ddp(pg_collection: Any, config: Any, ddp_config: Any) -> Any:
        groups = original.__func__(pg_collection, config, ddp_config)
        groups["intra_expt_dp_group"] = groups["intra_dp_cp_group"]
        groups["expt_dp_group"] = groups["dp_cp_group"]
        return groups

    ProcessGroupCollection.setup_process_groups_for_ddp = staticmethod(setup_process_groups_for_ddp)

    def undo() -> None:
        ProcessGroupCollection.setup_process_groups_for_ddp = original

    return undo


def test_expert_gradients_reduced_over_the_dense_group_are_named() -> None:
    first = _first_line(_expert_grads_over_the_dense_group, EP)
    assert first.startswith("grad of `decoder.layers.0.mlp.experts.local_experts."), first
    assert "expert parameters are reduced over the expert data-parallel group" in first, first


def _clipping_norm_of_the_local_shards() -> Callable[[], None]:
    """megatron's optimizer taking the gradient norm of each rank's own gradients, without
    the all-reduce over the model-parallel group: each tp rank clips by its own norm."""
    import torch
    from megatron.core.optimizer import optimizer

    original = optimizer.get_grad_norm_fp32

    def get_grad_norm_fp32(grads_for_norm: Any, norm_type: Any = 2, **_: Any) -> float:
        norms = [torch.linalg.vector_norm(g) for g in grads_for_norm]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    optimizer.get_grad_norm_fp32 = get_grad_norm_fp32

    def undo() -> None:
        optimizer.get_grad_norm_fp32 = original

    return undo


def test_a_clipping_norm_from_local_shards_is_named() -> None:
    """The gradients are recorded reduced, before clipping: the logged norm names it."""
    first = _first_line(_clipping_norm_of_the_local_shards, TP)
    assert first.startswith("logged `grad_norm` at step 1 on ranks 0, 1"), first
    assert "differs between ranks" in first, first
    assert "a clipping norm" in first, first


def test_experts_sliced_unlike_the_dense_tp_without_ep_miss_their_reduction() -> None:
    """A finding in megatron-core 0.16.1: ``ColumnParallelLinear`` / ``RowParallelLinear``
    mark an expert weight ``allreduce=False`` (reduce over the expert data-parallel group) only
    when ep > 1. With ep = 1 and an expert tp unlike the dense tp, DDP reduces the experts'
    gradients over the dense data-parallel group: here (tp=2, etp=1, sequence parallel) the two
    tp ranks route different tokens to whole experts, and nothing sums their gradients.
    Megatron-LM fixed it after 0.16.1 (NVIDIA/Megatron-LM#5916: ``use_expert_pgs`` also when
    ``expert_tensor_parallel_size != tensor_model_parallel_size``)."""
    result = check_equivalence(
        "megatron", 2, "gloo", real=True, timeout=TIMEOUT, **TP, expert_tensor_parallel_size=1
    )
    assert not result.passed
    first = result.error.splitlines()[0]
    assert first.startswith(
        "grad of `decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight` at step 1"
    ), first
    assert "the sum over tp (2 ranks, the tensor group) is the serial value" in first, first


def test_layouts_the_step_does_not_run_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match=r"context_parallel_size == 1.*TEDotProductAttention"):
        check_equivalence("megatron", 2, "gloo", real=True, context_parallel_size=2)


def test_threaded_ranks_are_refused_because_parallel_state_is_process_global() -> None:
    with pytest.raises(UsageError, match=r"backend 'gloo'.*process-global"):
        check_equivalence("megatron", 2, "threaded", real=True, timeout=TIMEOUT, **TP)


def test_a_step_after_a_smaller_moe_model_in_the_same_process_runs() -> None:
    """megatron's MoE aux-loss tracker is process-global and sized by the first model's layer
    count. A sweep runs every serial twin in one process: a 3-layer twin after a 2-layer one
    raised "index 2 is out of bounds for dimension 0 with size 2" (7 false failures in the
    world-8 megatron sweep, every pp=4 and pp=8 MoE layout). The tracker is left here as a
    2-layer model leaves it; the step must start from an empty one."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), 1, 2)
    config = {
        "pipeline_model_parallel_size": 3,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }
    from meshsim.own_steps import megatron as own
    from meshsim.usage.serial import assert_matches_serial

    try:
        result = assert_matches_serial(
            own.step(config), 3, "megatron", backend="gloo", batch=own.batch, timeout=TIMEOUT,
            **config,
        )  # fmt: skip
    finally:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    assert "over 2 steps" in str(result), result


def test_moe_steps_leave_their_warm_workers_in_service() -> None:
    """Each MoE step's model held its process groups in cycles through autograd's C++ nodes
    (DDP's grad-accumulator hooks, the token dispatcher's routing tensors), which no garbage
    collection frees: their gloo threads piled up until the pool retired the worker, and the
    next step paid a fresh worker's megatron import (most of a world-8 sweep's time). The
    same warm workers must serve step after step."""
    from meshsim.harness.pool import pool_pids

    _run(EP)
    warm = pool_pids()
    for _ in range(4):
        _run(EP)
    assert pool_pids() == warm
