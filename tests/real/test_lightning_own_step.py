"""Lightning 2.6.6's own training step (Fabric) against its serial twin (``meshsim.own_steps``).

The step is Lightning's: ``Fabric`` with ``ModelParallelStrategy`` on the CPU (its device mesh,
its setup of a docs-recipe parallelize function: ``parallelize_module`` on ``tensor_parallel``,
``fully_shard`` on ``data_parallel``), ``setup_dataloaders``' sampler, ``fabric.backward``,
``all_reduce`` of the loss, ``clip_gradients``. Passing layouts must pass; bugs planted in
Lightning's strategy and in the parallelize function (through the step's ``before`` hook,
inside every rank) must fail, naming the parameter and the likely mistake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshsim.errors import SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("lightning", "lightning"), pytest.mark.requires_framework("lightning")]

FSDP = {"data_parallel_size": 2, "tensor_parallel_size": 1}
TP = {"data_parallel_size": 1, "tensor_parallel_size": 2}
FSDP_TP = {"data_parallel_size": 2, "tensor_parallel_size": 2}
AUTO_TWO_NODES = {"num_nodes": 2}  # 'auto' sizes: data_parallel 2 (nodes), tensor_parallel 2


@pytest.fixture(autouse=True)
def _lightning_restored() -> Iterator[None]:
    """Threaded ranks share this process: put back what a planted bug replaced."""
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

    from meshsim.own_steps import lightning as own

    kept = dict(vars(ModelParallelStrategy))
    dims = own.TENSOR_DIM, own.DATA_DIM
    yield
    for key in set(vars(ModelParallelStrategy)) - set(kept):
        delattr(ModelParallelStrategy, key)
    for key, value in kept.items():
        if vars(ModelParallelStrategy).get(key) is not value:
            setattr(ModelParallelStrategy, key, value)
    own.TENSOR_DIM, own.DATA_DIM = dims


def _planted(world: int, config: dict[str, Any], before: Any) -> Any:
    from meshsim.own_steps import lightning as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before), world, "lightning", backend="threaded",
        batch=own.batch, timeout=600, **config,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("world", "config"),
    [
        (2, FSDP),
        (2, TP),
        (4, FSDP_TP),
        pytest.param(4, AUTO_TWO_NODES, marks=pytest.mark.slow),  # CI time: FSDP+TP again
    ],
    ids=["fsdp", "tp", "fsdp+tp-4", "auto-2-nodes-4"],
)
def test_lightnings_own_step_matches_its_serial_twin(world: int, config: dict[str, Any]) -> None:
    result = check_equivalence("lightning", world, "threaded", real=True, timeout=600, **config)
    assert result.passed, result.error
    assert "ModelParallelStrategy" in result.step
    assert "tensors over 2 steps" in result.summary, result.summary


def _fully_shard_on_the_tensor_parallel_dim() -> None:
    """The parallelize function taking the wrong dim of Lightning's mesh for FSDP2:
    ``device_mesh["tensor_parallel"]`` (one rank here) instead of ``["data_parallel"]``, so
    nothing reduces the gradients over the data-parallel ranks."""
    from meshsim.own_steps import lightning as own

    own.DATA_DIM = "tensor_parallel"


def test_fully_shard_on_the_wrong_mesh_dim_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP, _fully_shard_on_the_tensor_parallel_dim)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `tok_embeddings.weight` at step 1"), first
    assert "no collective reduced it on this rank" in first, first


def _sampler_over_the_world() -> None:
    """Lightning's ``distributed_sampler_kwargs`` answering with the world's rank and size
    instead of the ``data_parallel`` dim's: the two TP peers load different rows."""
    import torch.distributed as dist
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

    ModelParallelStrategy.distributed_sampler_kwargs = property(
        lambda self: {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}
    )


def test_tensor_parallel_peers_fed_different_rows_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, TP, _sampler_over_the_world)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `tok_embeddings.weight` at step 1"), first
    assert "a different batch" in first, first


def _clip_with_local_norm() -> None:
    """The strategy's gradient clipping taking the norm of each rank's own FSDP2 shards (no
    reduction of the norm over the mesh): each rank clips by its own norm."""
    import torch
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    def clip_gradients_norm(self: Any, module: Any, optimizer: Any, max_norm: float, **_: Any):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        total_norm = torch.nn.utils.get_total_norm(grads)
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:  # the local tensors of the DTensor gradients, in place
                grad.mul_(coefficient)
        return total_norm

    ModelParallelStrategy.clip_gradients_norm = clip_gradients_norm


def test_a_clipping_norm_from_local_shards_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP, _clip_with_local_norm)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `tok_embeddings.weight` at step 1"), first
    assert "the logged `grad_norm` at step 1 differs between ranks" in first, first
    assert "a clipping norm from each rank's own shards" in first, first


def test_layouts_the_step_does_not_run_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match=r"data_parallel_size=16: a global batch of 8 rows"):
        check_equivalence(
            "lightning", 16, "threaded", real=True, data_parallel_size=16, tensor_parallel_size=1
        )
