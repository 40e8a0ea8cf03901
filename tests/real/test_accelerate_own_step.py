"""accelerate 1.15's own training step against its serial twin (``meshsim.own_steps``).

The step is accelerate's: ``Accelerator(parallelism_config=..., fsdp_plugin=FSDP2).prepare`` of
a tiny transformers Llama (its ``fully_shard`` / DDP / TP preparation and its data-loader
sharding), ``backward``, ``reduce`` of the loss, ``clip_grad_norm_``. accelerate's state is a
process-wide singleton, so the N-rank step runs on gloo ranks. Passing layouts must pass; bugs
planted in accelerate's own methods (through the step's ``before`` hook, inside every rank;
the step puts them back after the run) must fail, naming the parameter and the likely mistake.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshsim.errors import RankFailure, SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("accelerate", "accelerate"), pytest.mark.requires_framework("accelerate")]

FSDP2 = {"dp_shard_size": 2}
DDP = {"dp_replicate_size": 2}
TP = {"tp_size": 2}
HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
TP4 = {"tp_size": 4}
DDP_DISPATCH = {"dp_replicate_size": 2, "dispatch_batches": True}  # rank 0 loads
CP = {"cp_size": 2}  # FSDP2 over dp_shard_cp (the cp ranks), ring attention over cp
FSDP_CP = {"dp_shard_size": 2, "cp_size": 2}


def _planted(world: int, config: dict[str, Any], before: Any) -> Any:
    from meshsim.own_steps import accelerate as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before), world, "accelerate", backend="gloo",
        batch=own.batch, timeout=600, **config,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("world", "config"),
    [
        (2, FSDP2),
        (2, DDP),
        (2, TP),
        pytest.param(2, DDP_DISPATCH, marks=pytest.mark.slow),  # CI time: the same paths
        pytest.param(4, HSDP, marks=pytest.mark.slow),
        pytest.param(4, TP4, marks=pytest.mark.slow),
        (2, CP),
        pytest.param(4, FSDP_CP, marks=pytest.mark.slow),  # 100 s under load
    ],
    ids=["fsdp2", "ddp", "tp", "ddp-dispatch", "hsdp-4", "tp-4", "cp", "fsdp+cp-4"],
)
def test_accelerates_own_step_matches_its_serial_twin(world: int, config: dict[str, Any]) -> None:
    result = check_equivalence("accelerate", world, "gloo", real=True, timeout=600, **config)
    assert result.passed, result.error
    assert "Accelerator(parallelism_config=" in result.step
    assert "tensors over 2 steps" in result.summary, result.summary


def _loader_without_the_mesh() -> None:
    """The data loader prepared without accelerate's device mesh (as ``prepare_data_loader``
    called without ``torch_device_mesh``): it shards over every process, so the two TP peers
    of a tensor-parallel model take different rows."""
    from accelerate.accelerator import Accelerator

    Accelerator._prepare_device_mesh = lambda self: None


def test_tensor_parallel_peers_fed_different_rows_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, TP, _loader_without_the_mesh)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `model."), first
    assert "a different batch" in first, first


def test_context_parallel_peers_fed_different_rows_are_named() -> None:
    """The same loader without the mesh under CP: it shards the batch over the two cp ranks as
    if they were data parallel (4 rows each), and CP then splits each rank's own rows along the
    sequence, so the ring attends across two different batches."""
    with pytest.raises(SerialMismatch) as info:
        _planted(2, CP, _loader_without_the_mesh)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `model."), first
    assert "a different batch" in first, first


def _fsdp_over_dp_shard_only() -> None:
    """accelerate's FSDP2 mesh without the cp dim (``ParallelismConfig.fsdp_dim_names`` naming
    ``dp_shard`` where accelerate names the flattened ``dp_shard_cp``): the cp peers, each
    holding half of every sequence, keep replicas whose gradients are never averaged over cp."""
    from accelerate.parallelism_config import ParallelismConfig

    def fsdp_dim_names(self: Any) -> list[str]:
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard"]

    ParallelismConfig.fsdp_dim_names = property(fsdp_dim_names)


@pytest.mark.slow  # world 4: 90 s under load
def test_gradients_not_averaged_over_context_parallel_ranks_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(4, FSDP_CP, _fsdp_over_dp_shard_only)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("grad of `model.embed_tokens.weight` at step 1"), first
    assert "a member missing from a reduction (a partial sum)" in first, first
    # the two cp coordinates (ranks 0, 2 and 1, 3 in the mesh dp_shard x cp) hold two values
    assert "differs between replicas: ranks 0, 2 hold one value, ranks 1, 3 another" in message


def _attention_within_each_ranks_chunk() -> None:
    """What a CPU attention that ignored the sequence sharding would compute, silently: each cp
    rank's queries against its own chunk of keys and values only, no ring."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    builtin = torch._C._nn.scaled_dot_product_attention

    def scaled_dot_product_attention(query: Any, key: Any, value: Any, *args: Any, **kw: Any):
        if not isinstance(query, DTensor):
            return builtin(query, key, value, *args, **kw)
        local = builtin(query.to_local(), key.to_local(), value.to_local(), *args, **kw)
        return DTensor.from_local(local, query.device_mesh, query.placements, run_check=False)

    F.scaled_dot_product_attention = scaled_dot_product_attention


def test_attention_within_each_ranks_chunk_is_named() -> None:
    """The silent failure a CPU context parallelism could have (torch 2.13's raises instead):
    the check fails on the first parameter whose gradient the missing keys change."""
    with pytest.raises(SerialMismatch) as info:
        _planted(2, CP, _attention_within_each_ranks_chunk)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `model."), first
    assert "at step 1" in first, first
    import torch
    import torch.nn.functional as F

    # put back in this process too, where the serial twin ran the planted hook
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _torchs_own_cpu_sdpa() -> None:
    """The step without its CPU stand-in: torch's SDPA as it is, which CP patches."""
    import torch
    import torch.nn.functional as F

    F.scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention


@pytest.mark.slow  # a control: what the stand-in is for (meshsim/own_steps/accelerate_cpu.py)
def test_context_parallel_on_cpu_needs_the_stand_in() -> None:
    """torch 2.13's context parallelism has no CPU attention: on a CPU, SDPA of CP's DTensors
    dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which neither CP nor DTensor
    handles, and every rank raises (loudly: no rank attends to its own chunk only). When a
    torch handles it, this test fails, and the stand-in can go."""
    with pytest.raises(RankFailure) as info:
        _planted(2, CP, _torchs_own_cpu_sdpa)
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
        "does not have a sharding strategy registered. (ranks 0, 1)"
    ), first


def _clip_with_local_norm() -> None:
    """accelerate's DTensor-aware clipping taking the norm of each rank's own FSDP2 shards (no
    reduction of the norm over the mesh): each rank clips by its own norm."""
    import torch
    from accelerate.accelerator import Accelerator
    from torch.distributed.tensor import DTensor

    def local(grad: Any) -> Any:
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def _clip_grad_norm_dtensor_aware(self: Any, parameters: Any, max_norm: float, norm_type=2):
        grads = [local(p.grad) for p in parameters if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type)
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:  # the local tensors of the DTensor gradients, in place
                grad.mul_(coefficient)
        return total_norm

    Accelerator._clip_grad_norm_dtensor_aware = _clip_grad_norm_dtensor_aware


def test_a_clipping_norm_from_local_shards_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP2, _clip_with_local_norm)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `model."), first
    assert "the logged `grad_norm` at step 1 differs between ranks" in first, first
    assert "a clipping norm from each rank's own shards" in first, first


def _default_split_batches() -> None:
    """accelerate's default ``DataLoaderConfiguration(split_batches=False)``: each data-parallel
    rank loads batches of its own share (the whole global batch at tp=2, dp=1)."""
    from meshsim.own_steps import accelerate as own

    own.SPLIT_BATCHES = False


def test_the_default_loader_steps_the_scheduler_once_per_tensor_parallel_rank_too() -> None:
    """A finding in accelerate 1.15: without ``split_batches``, ``AcceleratedScheduler.step``
    steps the scheduler ``AcceleratorState().num_processes`` times per optimizer step, because
    the prepared loader is that many times shorter. Under TP ``prepare_data_loader`` divides it
    by the data-parallel size only, yet the scheduler still counts every TP rank: at tp=2 (dp=1)
    each rank loads the same 8 rows as the serial twin, and the warmup advances twice per step.
    The first update agrees; the second, with a larger learning rate, does not."""
    with pytest.raises(SerialMismatch) as info:
        _planted(2, TP, _default_split_batches)
    first = str(info.value).splitlines()[0]
    assert first.startswith("`model.embed_tokens.weight` after 2 optimizer steps"), first
    assert "grad of" not in str(info.value), "the gradients of both steps agree"


def test_threaded_ranks_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match=r"process-wide singletons.*use --backend gloo"):
        check_equivalence("accelerate", 2, "threaded", real=True, timeout=300, **FSDP2)


@pytest.mark.parametrize(
    ("world", "config", "reason"),
    [
        (4, {"dp_shard_size": 2, "tp_size": 2}, r"ReplicateParallel from transformers"),
        (2, {"cp_size": 2, "dispatch_batches": True}, r"DataLoaderDispatcher reads only"),
        (3, {"cp_size": 3}, r"rows do not split into 3 equal sequence shards"),
        (2, {"sp_size": 2}, r"DeepSpeed's engine"),
        (2, {"tp_size": 2, "dispatch_batches": True}, r"DataLoaderDispatcher hands TP peers"),
    ],
    ids=["fsdp2+tp", "cp-dispatch", "cp-3", "sp", "tp-dispatch"],
)
def test_layouts_the_step_does_not_run_are_refused_with_the_reason(
    world: int, config: dict[str, Any], reason: str
) -> None:
    with pytest.raises(UsageError, match=reason):
        check_equivalence("accelerate", world, "gloo", real=True, **config)
