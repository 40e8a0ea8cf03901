"""DeepSpeed 0.19.8's own training step against its serial twin (``meshsim.own_steps``).

The step is DeepSpeed's: ``deepspeed.initialize`` on a tiny language model, its data loader,
``engine.backward`` / ``engine.step`` with gradient accumulation, ZeRO 1, 2 and 3 (its
partitioning, gradient reduction, clipping and optimizer), on gloo ranks. Passing layouts must
pass; bugs planted in DeepSpeed's own ZeRO optimizer (through the step's ``before`` hook, in
every rank process; each returns its undo, as the gloo workers are reused) must fail, naming
the parameter and the likely mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from meshsim.errors import SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("deepspeed", "deepspeed"), pytest.mark.requires_framework("deepspeed")]

TIMEOUT = 600.0
DATA = {"num_dp": 2}
MOE = {"num_dp": 2, "ep": 2}
AUTOTP = {"num_pp": 1, "num_mp": 1, "num_dp": 2, "autotp_size": 2}


def _planted(config: dict[str, Any], before: Callable[[], Any], stages: tuple[int, ...]) -> Any:
    from meshsim.own_steps import deepspeed as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before, stages=stages), 2, "deepspeed", backend="gloo",
        batch=own.batch, timeout=TIMEOUT, **config,
    )  # fmt: skip


def test_zero_1_2_and_3_match_their_serial_twin() -> None:
    result = check_equivalence("deepspeed", 2, "gloo", real=True, timeout=TIMEOUT, **DATA)
    assert result.passed, result.error
    assert "ZeRO stages 1, 2 and 3" in result.step
    # 2 ranks x 3 stages x (2 steps x (11 params + 11 grads + loss + grad_norm) + 11 final)
    assert "354 tensors over 2 steps" in result.summary, result.summary


def test_moe_with_expert_parallelism_matches_its_serial_twin() -> None:
    """ep=2 on 2 ranks: one expert each; ZeRO 1 and 2 (DeepSpeed refuses its MoE layer under
    ZeRO 3), expert gradients in their own ZeRO groups."""
    result = check_equivalence("deepspeed", 2, "gloo", real=True, timeout=TIMEOUT, **MOE)
    assert result.passed, result.error
    # 2 ranks x 2 stages x (2 steps x (16 params + 16 grads + 2 values) + 16 final)
    assert "256 tensors over 2 steps" in result.summary, result.summary


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "config"),
    [
        (2, {"num_pp": 2, "num_dp": 1}),
        (2, AUTOTP),
        (4, {"num_dp": 4}),
        (4, {"num_dp": 4, "ep": 2}),
        (4, {"num_pp": 2, "num_dp": 2}),
    ],
    ids=["pipeline-pp2", "autotp2", "zero123-dp4", "moe-ep2-dp4", "pipeline-pp2-dp2"],
)
def test_more_layouts_match_their_serial_twin(world: int, config: dict[str, Any]) -> None:
    result = check_equivalence("deepspeed", world, "gloo", real=True, timeout=TIMEOUT, **config)
    assert result.passed, result.error


def _gradients_summed() -> Callable[[], None]:
    """DeepSpeed's ZeRO-1/2 optimizer built with ``gradient_average=False``: the data-parallel
    reduction sums the ranks' gradients where their mean was needed."""
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    init = zero.DeepSpeedZeroOptimizer.__init__

    def summing(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "gradient_average": False})

    zero.DeepSpeedZeroOptimizer.__init__ = summing
    return lambda: setattr(zero.DeepSpeedZeroOptimizer, "__init__", init)


def test_gradients_summed_over_data_parallel_ranks_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(DATA, _gradients_summed, stages=(2,))
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `zero2.embed.weight` at step 1 on ranks 0, 1 is 2x"), first
    assert "a sum where a mean over one of them was needed" in first, first


def _experts_over_the_dense_group() -> Callable[[], None]:
    """DeepSpeed's ZeRO-1/2 gradient reduction taking the dense data-parallel group for every
    MoE group's expert data-parallel group: each expert's gradient is all-reduced with those
    of the other ranks' (different) experts."""
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    average = zero.DeepSpeedZeroOptimizer.average_tensor

    def dense(self: Any, *args: Any, **kwargs: Any) -> Any:
        kept = self.expert_dp_process_group
        self.expert_dp_process_group = {name: self.dp_process_group for name in kept or {}}
        try:
            return average(self, *args, **kwargs)
        finally:
            self.expert_dp_process_group = kept

    zero.DeepSpeedZeroOptimizer.average_tensor = dense
    return lambda: setattr(zero.DeepSpeedZeroOptimizer, "average_tensor", average)


def test_expert_gradients_reduced_over_the_dense_group_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(MOE, _experts_over_the_dense_group, stages=(1,))
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `zero1.block.mlp.deepspeed_moe.experts."), first
    assert "expert data-parallel group, not the dense data-parallel one" in first, first


def _clip_with_local_norm() -> Callable[[], None]:
    """DeepSpeed's ZeRO-1/2 gradient norm without its all-reduce: each rank clips by the norm
    of its own gradient partitions."""
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    norm = zero.DeepSpeedZeroOptimizer.scaled_global_norm

    class LocalOnly:
        def __init__(self, real: Any) -> None:
            self._real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def all_reduce(self, *args: Any, **kwargs: Any) -> None:
            return None

    def local_norm(self: Any, *args: Any, **kwargs: Any) -> Any:
        real = zero.dist
        zero.dist = LocalOnly(real)
        try:
            return norm(self, *args, **kwargs)
        finally:
            zero.dist = real

    zero.DeepSpeedZeroOptimizer.scaled_global_norm = local_norm
    return lambda: setattr(zero.DeepSpeedZeroOptimizer, "scaled_global_norm", norm)


def test_a_clipping_norm_from_local_partitions_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(DATA, _clip_with_local_norm, stages=(1,))
    first = str(info.value).splitlines()[0]
    assert first.startswith("logged `zero1.grad_norm` at step 1 on ranks 0, 1"), first
    assert "differs between ranks" in first, first
    assert "a clipping norm" in first, first


def _autotp_batch_math() -> tuple[int, int, int]:
    """On a rank: (accumulation steps, data-parallel size, train_batch_size) of an engine
    with ``tensor_parallel.autotp_size`` 2 from the config alone (no mpu)."""
    import deepspeed

    from meshsim.builders.real import _shims
    from meshsim.own_steps import deepspeed as own

    own._load()
    with (
        _shims.unchanged_environ(),
        _shims.deepspeed_comm(),
        _shims.deepspeed_clean_moe_state(),
        own._fresh_globals(),
    ):
        model = own._plain_model(0, 1, 0, False)
        engine, *_ = deepspeed.initialize(model=model, config=own._ds_config(1, AUTOTP, 2))
        try:
            return (
                engine.gradient_accumulation_steps(),
                engine.dp_world_size,
                engine.train_batch_size(),
            )
        finally:
            engine.destroy()


def test_autotp_from_the_config_alone_trains_half_the_batch() -> None:
    """A finding in DeepSpeed 0.19.8: ``deepspeed.initialize`` builds its ``DeepSpeedConfig``
    before the engine makes AutoTP's groups, so without an ``mpu`` it sizes the batch by the
    world (2 ranks), not the data-parallel group (1): ``train_batch_size`` 16 over micro-batches
    of 2 gives 4 accumulation steps, and each step trains 2 x 4 x 1 = 8 rows. The serial twin
    trains all 16: the first gradient differs (a different batch). With DeepSpeed's own
    ``groups`` as the mpu (what the step does by default) the layout passes."""
    from meshsim.harness import run

    assert list(run(_autotp_batch_math, 2, "gloo", TIMEOUT)) == [(4, 1, 16)] * 2
    with pytest.raises(SerialMismatch) as info:
        from meshsim.own_steps import deepspeed as own
        from meshsim.usage.serial import assert_matches_serial

        assert_matches_serial(
            own.step(AUTOTP, stages=(1,), autotp_mpu=False), 2, "deepspeed", backend="gloo",
            batch=own.batch, timeout=TIMEOUT, **AUTOTP,
        )  # fmt: skip
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `zero1.embed.weight` at step 1 on ranks 0, 1 differs"), first
    assert "a different batch" in first, first


def test_layouts_the_step_does_not_run_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match=r"num_mp=2: .*AutoTP"):
        check_equivalence("deepspeed", 4, "gloo", real=True, num_pp=1, num_mp=2, num_dp=2)
    with pytest.raises(UsageError, match=r"needs the layout's sizes"):
        check_equivalence("deepspeed", 2, "gloo", real=True)
    with pytest.raises(UsageError, match=r"run its ranks as processes, --backend gloo"):
        check_equivalence("deepspeed", 2, "threaded", real=True, **DATA)
