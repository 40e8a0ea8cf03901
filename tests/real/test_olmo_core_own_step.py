"""OLMo-core 3.0.0's own training step against its serial twin (``meshsim.own_steps``).

The step is OLMo-core's: its ``TransformerTrainModule`` on the olmo2_1M model, parallelized
by its own ``apply_fsdp`` / ``apply_tp``, its loss, clipping and ``SkipStepAdamW``. Passing
layouts must pass; bugs planted in copies of OLMo-core's own functions (through the step's
``before`` hook, inside every rank) must fail, naming the parameter and the likely mistake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshsim.errors import SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("olmo-core", "olmo_core"), pytest.mark.requires_framework("olmo-core")]

FSDP = {"dp": "fsdp"}
FSDP_TP = {"dp": "fsdp", "tp": 2}


@pytest.fixture(autouse=True)
def _olmo_restored() -> Iterator[None]:
    """Threaded ranks share this process: put back what a planted bug replaced."""
    from meshsim.builders.real import _shims

    _shims.load("olmo_core", "olmo_core.train.train_module.transformer.train_module")
    from olmo_core.train.train_module.transformer import train_module

    kept = (train_module.TransformerTrainModule._clip_grad_norm, train_module.get_dp_process_group)
    yield
    train_module.TransformerTrainModule._clip_grad_norm, train_module.get_dp_process_group = kept


def _planted(world: int, config: dict[str, Any], before: Any) -> Any:
    from meshsim.own_steps import olmo_core as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before), world, "olmo-core", backend="threaded",
        batch=own.batch, timeout=300, **config,
    )  # fmt: skip


@pytest.mark.parametrize("config", [FSDP, FSDP_TP], ids=["fsdp", "fsdp+tp"])
def test_olmo_cores_own_step_matches_its_serial_twin(config: dict[str, Any]) -> None:
    result = check_equivalence("olmo-core", 2, "threaded", real=True, timeout=300, **config)
    assert result.passed, result.error
    assert "TransformerTrainModule.train_batch" in result.step
    assert "478 tensors over 2 steps" in result.summary


def _clip_with_local_norm() -> None:
    """OLMo-core's ``_clip_grad_norm`` taking the norm of each rank's own shards (no
    ``full_tensor()`` of a norm over local tensors): each rank clips by its own norm."""
    import torch
    from olmo_core.distributed.utils import get_local_tensor
    from olmo_core.train.train_module.transformer import train_module

    def _clip_grad_norm(self: Any, max_grad_norm: float, norm_type: float = 2.0, foreach=None):
        parameters = list(self.model.parameters())
        grads = [get_local_tensor(p.grad) for p in parameters if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, total_norm)
        return total_norm

    train_module.TransformerTrainModule._clip_grad_norm = _clip_grad_norm


def test_a_clipping_norm_from_local_shards_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP, _clip_with_local_norm)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `"), first
    assert "the logged `grad_norm` at step 1 differs between ranks" in first, first
    assert "a clipping norm from each rank's own shards" in first, first


def _world_as_data_parallel_group() -> None:
    """OLMo-core's train module asking for the world group where it needs the data-parallel
    group: under TP, its two TP peers each take half of the global batch."""
    import torch.distributed as dist
    from olmo_core.train.train_module.transformer import train_module

    train_module.get_dp_process_group = lambda mesh: dist.group.WORLD


def test_tensor_parallel_peers_fed_different_rows_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP_TP, _world_as_data_parallel_group)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `"), first
    assert "a different batch" in first or "differs from the serial one" in first, first


def test_layouts_the_step_does_not_run_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match=r"pp=2: its pipeline schedules"):
        check_equivalence("olmo-core", 4, "threaded", real=True, dp="fsdp", pp=2)


def test_ddp_over_a_tensor_parallel_model_trains_nothing() -> None:
    """A finding in OLMo-core 3.0.0 with torch 2.13 (and 2.15): ``apply_ddp`` uses torch's
    ``replicate``, whose DDP+TP work-around swaps the model's DTensor parameters for local
    ones at the first forward (pytorch/pytorch#152712). The optimizer, built before, holds
    the originals: they never get a gradient, and nothing trains."""
    result = check_equivalence("olmo-core", 2, "threaded", real=True, timeout=300, dp="ddp", tp=2)
    assert not result.passed
    first = result.error.splitlines()[0]
    assert first.startswith("`embeddings.weight` (grads) is in the serial step but no rank"), first
    assert "not the tensor the model trains with" in first
