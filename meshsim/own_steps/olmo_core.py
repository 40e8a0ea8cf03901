"""OLMo-core 3.0.0's own training step, on N ranks and alone, for the equivalence check.

What runs is what ``olmo_core.train.Trainer`` runs per step, with OLMo's own objects:
``TransformerConfig.olmo2_1M`` (vocab 2048, 8 heads so that TP or CP up to 8 splits them)
built on ``meta``; ``TransformerTrainModuleConfig.build``, which builds OLMo's world mesh,
parallelizes the model (``apply_cp`` / ``apply_tp`` / ``apply_ep`` / ``apply_fsdp`` /
``apply_ddp``), initialises the weights and builds ``SkipStepAdamW``; then per step
``train_batch`` (micro-batches of 2 rows, 1 where 8 data-parallel ranks share the 8 rows:
gradient accumulation), ``optim_step`` (OLMo's gradient clipping at ``max_grad_norm`` 0.5,
which clips here, the cosine schedule, the update) and ``zero_grads``. The serial twin is the
same model without any parallelism config, on one rank.

With ``cp`` the config is OLMo's ``TransformerContextParallelConfig.ulysses(cp)``: the model
shards each row's tokens and RoPE buffers over the cp group itself (``UlyssesLoadBalancer``,
contiguous chunks), its torch SDPA backend swaps sequence for heads with an all-to-all over
the cp group around attention, the LM head divides the loss by the token count over cp, and
FSDP / DDP reduce over dp x cp (``get_dp_model_mesh``). Ulysses is the style OLMo's torch
attention backend takes on any device; its ring styles (``zig_zag``, ``llama3``) are refused
by that backend (``TorchAttentionBackend.assert_supports_ring_cp`` raises "doesn't support
ring context parallelism") and need ``FlashAttention2Backend`` (flash-attn and
ring-flash-attn, CUDA only) or ``TEAttentionBackend`` (TransformerEngine, CUDA streams), so
they do not run here. On gloo, the K/V all-to-all goes through torch's
``torch.distributed.nn.functional.all_to_all``, whose gloo path mixes group and global ranks
and raises in any cp group other than ranks 0, 1, ...;
:mod:`meshsim.own_steps.olmo_core_cpu` runs its scatters by group rank (the same data).

A layout with an expert-parallel config (``ep``; OLMo requires HSDP with ``ep`` = the shard
degree) runs one of OLMo's smallest MoE configs instead, ``TransformerConfig.small_hybrid_moe``
cut down to ``MOE_D_MODEL`` = 16 (experts' hidden size 8, the dense MLP's 32), ``MOE_LAYERS``
= 2 and ``MOE_HEADS`` = 4: each block a dense MLP beside a capacity-based ``MoE`` with 32
experts, top-4 softmax routing, capacity factor 1.2 (tokens beyond an expert's capacity are
dropped, the same ones on both sides), load-balancing loss (0.01, granularity
``local_batch``) and router z-loss (0.001), as the config has them. (``smallmoe``, the other
one of that size, has a shared MLP that OLMo's ``init_weights`` leaves to torch's
``nn.Linear.reset_parameters`` on the global RNG, not to ``init_seed``: its initial weights
are whatever that RNG's state gives, here different on every rank and in the twin.)
``TransformerExpertParallelConfig(ep)`` makes the train module shard the experts over
``get_ep_mesh`` (the ``dp_shard`` dim) with ``apply_ep``, exchange tokens with OLMo's
``all_to_all`` over that group, and ``prepare_experts_for_fsdp`` shard each rank's experts
over ``dp_replicate`` before ``apply_fsdp``. Micro-batches are one row each
(``MOE_MICROBATCH_ROWS``): the local_batch load-balancing loss is a product of sums over one
micro-batch's tokens, so only then do the N-rank and serial micro-batches hold the same rows.
Besides the loss and gradient norm, the Trainer's logged ``load balancing loss`` and
``router Z loss`` (summed over the MoE blocks, reduced over every rank as
``Trainer._log_metrics`` reduces them) are compared. Its serial twin is the same MoE model on
one rank. OLMo's MoE ops call triton kernels for the token permutation, which a CPU torch
lacks; :mod:`meshsim.own_steps.olmo_core_cpu` computes the same numbers with torch indexing
(it says how), and nothing else is replaced.

Pipeline parallelism does not run on the CPU: OLMo-core 3.0.0's pipeline train module takes
only its custom schedules, whose constructor and p2p transport use CUDA streams and events
(:func:`refusal` names the calls).

OLMo's initialisation fills every full tensor from ``init_seed`` and keeps the rank's shard,
so every rank and the twin start from the same weights without a separate CPU build. Each
rank takes rows ``dp_rank::dp_world_size`` of the global batch, as OLMo's numpy data loader
does, with the rank and size of the train module's data-parallel group (cp peers take the
same rows). The logged loss is what ``Trainer._log_metrics`` computes (``reduce_metrics``
over the ranks); ``ctx.record`` runs in an optimizer step pre-hook, after clipping and
before the update.

The Trainer is a stand-in (:class:`TrainerStandIn`): the four attributes the train module
reads, and OLMo's own ``Trainer.record_metric`` / ``record_ce_loss`` bound to it. Two more
stand-ins serve threaded ranks, which share one process: ``build_world_mesh`` runs with a
private copy of its module globals (it refuses a second call per process; the global it
keeps is read only by optimizers, a profiler callback and ``MoEBase.apply_pp``, none of which
runs here), and OLMo's ``backend_supports_cpu`` also answers True for torch's in-process
``threaded`` backend (it knows gloo and MPI; the answer only picks the CPU device).
``before``, when given, runs on each rank and in the twin before anything is built: tests
plant bugs there.
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
HEADS = 8  # olmo2_1M has 4; 8 lets its heads split over a tensor- or context-parallel group of 8
#: small_hybrid_moe cut down: d_model 768 -> 16 (its experts' hidden size is d_model / 2, its
#: dense MLP's 2 * d_model), 12 layers -> 2, 12 heads -> 4; its 32 experts, top-4 routing,
#: capacity factor, load-balancing and router z losses as they are.
MOE_D_MODEL = 16
MOE_LAYERS = 2
MOE_HEADS = 4
#: The MoE's load-balancing loss (OLMo's default ``local_batch`` granularity) is a product of
#: sums over the tokens of one micro-batch, so it depends on which rows share a micro-batch:
#: with one row a micro-batch, the N-rank and serial micro-batches hold the same rows.
MOE_MICROBATCH_ROWS = 1
#: The router metrics the Trainer logs (summed over the MoE blocks, reduced over every rank).
MOE_METRICS = ("load balancing loss", "router Z loss")

WHAT_RUNS = (
    "OLMo-core's own train-module step: TransformerTrainModule.train_batch (its loss, "
    "micro-batches), optim_step (its gradient clipping, SkipStepAdamW, cosine schedule) "
    "on its olmo2_1M transformer, or with ep its small_hybrid_moe MoE, parallelized by its "
    "own apply_cp (Ulysses) / apply_tp / apply_ep / apply_fsdp / apply_ddp"
)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    for key, why in (
        (
            "pp",
            "OLMo-core 3.0.0's pipeline train module runs only its custom schedules (its "
            "PipelineSchedule refuses torch's 1F1B, Interleaved1F1B, GPipe: 'Only the custom "
            "schedules are wired up'), and those need CUDA: CustomInterleaved1F1B's __init__ "
            "builds a GPUActivationOffloader, whose olmo_core.utils.get_or_init_stream calls "
            "torch.cuda.Stream (RuntimeError 'torch.cuda.Stream requires CUDA support' here), "
            "and moves a tensor to torch.cuda.current_device(); its p2p transport records "
            "torch.cuda events on CUDA streams",
        ),
        (
            "expert_mesh_ep",
            "build_expert_parallel_mesh is a mesh the train module never builds (its MoE "
            "step shards experts over the world mesh's ep config: give --ep with --set dp=hsdp)",
        ),
    ):
        if config.get(key) not in (None, 1):
            return f"OLMo-core's own step with {key}={config[key]}: {why}"
    split = config.get("num_replicas") is not None or config.get("shard_degree") is not None
    if config.get("dp") == "hsdp" and config.get("num_nodes", 1) != 1 and not split:
        return (
            "OLMo-core's own step splits HSDP by its ranks' LOCAL_WORLD_SIZE, not by "
            "--num-nodes: give --num-replicas or --shard-degree instead"
        )
    if uses_experts(config) and config.get("cp") not in (None, 1):
        return (
            f"OLMo-core's own step with ep={config['ep']} and cp={config['cp']}: its MoE's "
            "load-balancing loss (granularity local_batch, smallmoe's) is computed over each "
            "context-parallel rank's sequence shard, by design not over the whole rows the "
            "serial twin sees, so no twin computes the same step"
        )
    return None


def uses_experts(config: Mapping[str, Any]) -> bool:
    """Whether the layout runs the MoE model: when it has an expert-parallel config (OLMo
    applies EP to MoE models only). Its serial twin runs the same MoE model on one rank."""
    return config.get("ep") is not None


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


def _quiet() -> None:
    """Drop two notices torch prints on every rank under CP, saying nothing about the step:
    OLMo's ``get_cp_mesh`` slices a flattened dim (deprecated from torch 2.11), and its Ulysses
    all-to-all uses ``torch.distributed.nn.functional.all_to_all_single`` (deprecated)."""
    import warnings

    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all")


def _parallel_configs(config: Mapping[str, Any], serial: bool) -> dict[str, Any]:
    """The train module's parallelism configs (OLMo's own classes) for ``config``; none in the
    serial twin. Context parallelism is OLMo's Ulysses style, the one its torch attention
    backend takes (see the module's note)."""
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.train_module import (
        TransformerContextParallelConfig,
        TransformerDataParallelConfig,
        TransformerExpertParallelConfig,
        TransformerTensorParallelConfig,
    )

    configs: dict[str, Any] = {}
    if serial:
        return configs
    if config.get("dp") is not None:
        configs["dp_config"] = TransformerDataParallelConfig(
            name=DataParallelType(config["dp"]),
            num_replicas=config.get("num_replicas"),
            shard_degree=config.get("shard_degree"),
        )
    if config.get("tp") is not None:
        configs["tp_config"] = TransformerTensorParallelConfig(degree=int(config["tp"]))
    if config.get("cp") is not None:
        configs["cp_config"] = TransformerContextParallelConfig.ulysses(int(config["cp"]))
    if config.get("ep") is not None:
        configs["ep_config"] = TransformerExpertParallelConfig(degree=int(config["ep"]))
    return configs


def _model(moe: bool, seed: int) -> Any:
    """OLMo's own model config, built on ``meta``: olmo2_1M, or for an EP layout
    small_hybrid_moe cut down to ``MOE_D_MODEL`` / ``MOE_LAYERS`` / ``MOE_HEADS``."""
    from olmo_core.nn.transformer import TransformerConfig

    if moe:
        config = TransformerConfig.small_hybrid_moe(
            vocab_size=VOCABULARY, d_model=MOE_D_MODEL, n_layers=MOE_LAYERS, n_heads=MOE_HEADS
        )
        config.init_seed = seed  # small_hybrid_moe takes no init_seed
    else:
        config = TransformerConfig.olmo2_1M(vocab_size=VOCABULARY, n_heads=HEADS, init_seed=seed)
    return config.build(init_device="meta")


def _step(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch

    from meshsim.builders.real import _shims
    from meshsim.dataflow import recipes
    from meshsim.own_steps import olmo_core_cpu as cpu

    _shims.load("olmo_core", "olmo_core.train.train_module.transformer.train_module")
    _stand_ins()
    _quiet()
    moe = uses_experts(config)
    if moe:
        cpu.cpu_kernels()
    if config.get("cp") is not None:
        cpu.gloo_all_to_all()
    recipes._quiet()
    if before is not None:
        before()

    from olmo_core.distributed.utils import get_rank, get_world_size
    from olmo_core.optim import CosWithWarmup, SkipStepAdamWConfig
    from olmo_core.train.common import TRAIN_CE_LOSS_METRIC
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.utils import reduce_metrics

    from meshsim.errors import UsageError

    configs = _parallel_configs(config, ctx.serial)
    # The train module's data-parallel group is every rank outside the TP and CP groups (pp is
    # refused); OLMo requires the global batch to split into micro-batches on each of them.
    model_parallel = 1
    for key in ("tp_config", "cp_config"):
        if key in configs:
            model_parallel *= configs[key].degree
    rows = GLOBAL_BATCH // max(1, ctx.world_size // model_parallel)
    microbatch = MOE_MICROBATCH_ROWS if moe else MICROBATCH_ROWS
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=max(1, min(microbatch, rows)) * SEQUENCE,
        max_sequence_length=SEQUENCE,
        optim=SkipStepAdamWConfig(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95)),
        max_grad_norm=MAX_GRAD_NORM,
        scheduler=CosWithWarmup(warmup=1),
        **configs,
    ).build(_model(moe, ctx.seed), device=torch.device("cpu"))
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

    logged = {TRAIN_CE_LOSS_METRIC: "loss"}
    if moe:
        logged.update({f"train/{name}": name.replace(" ", "_") for name in MOE_METRICS})

    def before_update(optimizer: Any, args: Any, kwargs: Any) -> None:
        metrics = trainer._metrics[trainer.global_step]
        # Trainer._log_metrics: reduce_metrics over every rank, each with its reduce type.
        reduced = reduce_metrics(
            {trainer.global_step: {name: metrics[name] for name in logged}},
            {name: trainer._metrics_reduce_type[name] for name in logged},
            torch.device("cpu"),
        )[trainer.global_step]
        ctx.record(
            recordable(),
            **{key: torch.tensor(reduced[name]) for name, key in logged.items()},
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
