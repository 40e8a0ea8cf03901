"""OLMo-core 3.0.0's own training step, on N ranks and alone, for the equivalence check.

What runs is what ``olmo_core.train.Trainer`` runs per step, with OLMo's own objects:
``TransformerConfig.olmo2_1M`` (vocab 2048, 8 heads so that TP up to 8 splits them) built on
``meta``; ``TransformerTrainModuleConfig.build``, which builds OLMo's world mesh,
parallelizes the model (``apply_tp`` / ``apply_fsdp`` / ``apply_ddp``), initialises the
weights and builds ``SkipStepAdamW``; then per step ``train_batch`` (micro-batches of 2 rows,
1 where 8 data-parallel ranks share the 8 rows: gradient accumulation), ``optim_step``
(OLMo's gradient clipping at ``max_grad_norm`` 0.5, which clips here, the cosine schedule,
the update) and ``zero_grads``. The serial twin is the same config without a data- or
tensor-parallel config, on one rank.

OLMo's initialisation fills every full tensor from ``init_seed`` and keeps the rank's shard,
so every rank and the twin start from the same weights without a separate CPU build. Each
rank takes rows ``dp_rank::dp_world_size`` of the global batch, as OLMo's numpy data loader
does, with the rank and size of the train module's data-parallel group. The logged loss is
what ``Trainer._log_metrics`` computes (``reduce_metrics`` over the ranks); ``ctx.record``
runs in an optimizer step pre-hook, after clipping and before the update.

The Trainer is a stand-in (:class:`TrainerStandIn`): the four attributes the train module
reads, and OLMo's own ``Trainer.record_metric`` / ``record_ce_loss`` bound to it. Two more
stand-ins serve threaded ranks, which share one process: ``build_world_mesh`` runs with a
private copy of its module globals (it refuses a second call per process; the global it
keeps is read only by optimizers and MoE code that do not run here), and OLMo's
``backend_supports_cpu`` also answers True for torch's in-process ``threaded`` backend (it
knows gloo and MPI; the answer only picks the CPU device). ``before``, when given, runs on
each rank and in the twin before anything is built: tests plant bugs there.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

GLOBAL_BATCH = 8  # rows: splits over a data-parallel group of 1, 2, 4 or 8 ranks
SEQUENCE = 64
VOCABULARY = 2048
MICROBATCH_ROWS = 2  # at most: a data-parallel group of 8 takes one row each
MAX_GRAD_NORM = 0.5
HEADS = 8  # olmo2_1M has 4; 8 lets its heads split over a tensor-parallel group of 8

WHAT_RUNS = (
    "OLMo-core's own train-module step: TransformerTrainModule.train_batch (its loss, "
    "micro-batches), optim_step (its gradient clipping, SkipStepAdamW, cosine schedule) "
    "on its olmo2_1M transformer, parallelized by its own apply_fsdp / apply_tp / apply_ddp"
)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    for key, why in (
        ("pp", "its pipeline schedules are not run yet"),
        ("cp", "its context-parallel input split is not run yet"),
        ("ep", "the olmo2_1M model is dense (no experts); the MoE step is not run yet"),
        ("expert_mesh_ep", "the olmo2_1M model is dense (no experts)"),
    ):
        if config.get(key) not in (None, 1):
            return f"OLMo-core's own step with {key}={config[key]}: {why}"
    split = config.get("num_replicas") is not None or config.get("shard_degree") is not None
    if config.get("dp") == "hsdp" and config.get("num_nodes", 1) != 1 and not split:
        return (
            "OLMo-core's own step splits HSDP by its ranks' LOCAL_WORLD_SIZE, not by "
            "--num-nodes: give --num-replicas or --shard-degree instead"
        )
    return None


def batch(step: int) -> Any:
    """A step's global batch: token ids; OLMo's ``get_labels`` shifts them into labels."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE), dtype=torch.int64)


def step(
    config: Mapping[str, Any], before: Callable[[], None] | None = None
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`."""
    return functools.partial(_step, dict(config), before)


class TrainerStandIn:
    """What ``TransformerTrainModule`` reads from ``olmo_core.train.Trainer`` in a step."""

    def __init__(self, dp_process_group: Any, max_steps: int) -> None:
        from olmo_core.train.trainer import Trainer

        self.global_step = 0
        self.max_steps = max_steps
        self.global_batch_size = GLOBAL_BATCH * SEQUENCE  # in tokens, as the Trainer's
        self.dp_process_group = dp_process_group
        self._metrics: dict[int, Any] = {}
        self._metrics_reduce_type: dict[str, Any] = {}
        self.record_metric = types.MethodType(Trainer.record_metric, self)
        self.record_ce_loss = types.MethodType(Trainer.record_ce_loss, self)


_LOCK = threading.Lock()


def _private_build_world_mesh(**kwargs: Any) -> Any:
    """OLMo's ``build_world_mesh`` with its own copy of the module globals."""
    from olmo_core.distributed import parallel

    fn = parallel.build_world_mesh
    scope = {**fn.__globals__, "_WORLD_MESH": None}
    private = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    private.__kwdefaults__ = fn.__kwdefaults__
    return private(**kwargs)


def _stand_ins() -> None:
    with _LOCK:
        from olmo_core.distributed import utils as dist_utils
        from olmo_core.train.train_module.transformer import train_module

        if train_module.build_world_mesh is not _private_build_world_mesh:
            train_module.build_world_mesh = _private_build_world_mesh
        if getattr(dist_utils.backend_supports_cpu, "__meshsim__", False):
            return
        original = dist_utils.backend_supports_cpu

        def backend_supports_cpu(backend: Any = None) -> bool:
            import torch.distributed as dist

            if dist.is_initialized() and str(backend or dist.get_backend()) == "threaded":
                return True
            return bool(original(backend))

        backend_supports_cpu.__meshsim__ = True  # type: ignore[attr-defined]
        dist_utils.backend_supports_cpu = backend_supports_cpu


def _parallel_configs(config: Mapping[str, Any], serial: bool) -> tuple[Any, Any]:
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.train_module import (
        TransformerDataParallelConfig,
        TransformerTensorParallelConfig,
    )

    if serial:
        return None, None
    dp = tp = None
    if config.get("dp") is not None:
        dp = TransformerDataParallelConfig(
            name=DataParallelType(config["dp"]),
            num_replicas=config.get("num_replicas"),
            shard_degree=config.get("shard_degree"),
        )
    if config.get("tp") is not None:
        tp = TransformerTensorParallelConfig(degree=int(config["tp"]))
    return dp, tp


def _step(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch

    from meshsim.builders.real import _shims
    from meshsim.dataflow import recipes

    _shims.load("olmo_core", "olmo_core.train.train_module.transformer.train_module")
    _stand_ins()
    recipes._quiet()
    if before is not None:
        before()

    from olmo_core.distributed.utils import get_rank, get_world_size
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import CosWithWarmup, SkipStepAdamWConfig
    from olmo_core.train.common import TRAIN_CE_LOSS_METRIC
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.utils import reduce_metrics

    from meshsim.errors import UsageError

    dp_config, tp_config = _parallel_configs(config, ctx.serial)
    # The train module's data-parallel group is every rank outside the TP group (cp and pp are
    # refused); OLMo requires the global batch to split into micro-batches on each of them.
    tp_size = 1 if tp_config is None else tp_config.degree
    rows = GLOBAL_BATCH // max(1, ctx.world_size // tp_size)
    model = TransformerConfig.olmo2_1M(
        vocab_size=VOCABULARY, n_heads=HEADS, init_seed=ctx.seed
    ).build(init_device="meta")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=max(1, min(MICROBATCH_ROWS, rows)) * SEQUENCE,
        max_sequence_length=SEQUENCE,
        optim=SkipStepAdamWConfig(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95)),
        max_grad_norm=MAX_GRAD_NORM,
        scheduler=CosWithWarmup(warmup=1),
        dp_config=dp_config,
        tp_config=tp_config,
    ).build(model, device=torch.device("cpu"))
    # The parameters the optimizer updates, by name, as the train module built them.
    trained = dict(train_module.model.named_parameters())

    def recordable() -> Any:
        """The model (meshsim's trace finds its DDP / FSDP wrappers there) while its registered
        parameters are still the optimizer's; else the optimizer's, by their names."""
        now = {id(p) for p in train_module.model.parameters()}
        return train_module.model if now == {id(p) for p in trained.values()} else trained

    dp_group = train_module.dp_process_group
    dp_size, dp_rank = get_world_size(dp_group), get_rank(dp_group)
    if GLOBAL_BATCH % dp_size:
        raise UsageError(
            f"OLMo-core's own step: a global batch of {GLOBAL_BATCH} rows does not split over "
            f"{dp_size} data-parallel ranks"
        )
    trainer = TrainerStandIn(dp_group, max_steps=ctx.steps + 1)
    train_module._attach_trainer(trainer)
    train_module.pre_train()

    def before_update(optimizer: Any, args: Any, kwargs: Any) -> None:
        metrics = trainer._metrics[trainer.global_step]
        reduce_type = {TRAIN_CE_LOSS_METRIC: trainer._metrics_reduce_type[TRAIN_CE_LOSS_METRIC]}
        # Trainer._log_metrics: reduce_metrics over every rank.
        reduced = reduce_metrics(
            {trainer.global_step: {TRAIN_CE_LOSS_METRIC: metrics[TRAIN_CE_LOSS_METRIC]}},
            reduce_type,
            torch.device("cpu"),
        )
        ctx.record(
            recordable(),
            loss=torch.tensor(reduced[trainer.global_step][TRAIN_CE_LOSS_METRIC]),
            grad_norm=metrics["optim/total grad norm"].detach().clone(),
        )

    train_module.optim.register_step_pre_hook(before_update)
    train_module.zero_grads()
    for i in range(ctx.steps):
        trainer.global_step += 1
        train_module.train_batch({"input_ids": ctx.batch(i)[dp_rank::dp_size].contiguous()})
        train_module.optim_step()
        train_module.zero_grads()
    return recordable()
