"""torchtitan 0.3.0's own training step, on N ranks and alone, for the equivalence check.

What runs is the trainer's step (``torchtitan.trainer.Trainer.__init__`` and ``train_step``)
without the tokenizer, data loader, checkpointer and metrics: ``ParallelDims.from_config``
and ``build_mesh``; the llama3 debug model; torchtitan's ``parallelize_llama`` (FSDP / HSDP,
TP with sequence parallelism, CP); the loss its config builds (``ChunkedLossWrapper`` over
cross entropy) normalised by the global count of valid tokens (``dist_sum_tensor`` over the
batch mesh); ``clip_grad_norm_``; its AdamW and LR schedule. With cp > 1 each rank's rows are
split over cp by torchtitan's ``prepare_context_parallel_input`` (inputs, labels, positions
and the attention mask, with the configured load balancer), after the valid tokens are
counted, as the trainer's ``post_dataloading_process`` does; torch's FlexAttention CP needs
``cp * 128`` tokens a row, so such a layout (and its twin) trains on that length. The serial
twin is the same config with every degree 1.

A layout with expert parallelism (``ep > 1``) runs torchtitan's MoE debug model instead: the
smallest one whose family's ``parallelize_*`` takes EP, deepseek_v3's ``debugmodel`` (33M
parameters: 6 layers, the first dense, then MoE with 8 routed experts, top-3 softmax routing
and 2 shared experts; qwen3's ``debugmodel_moe`` has 316M, gpt_oss's 81M) cut to its first
``MOE_LAYERS`` layers (one dense, one MoE: every code path, a third of the cost), through
``parallelize_deepseekv3``: the experts sharded over the ``ep`` mesh and their tokens sent
by ``AllToAllTokenDispatcher`` (``all_to_all_single``), FSDP of the experts over ``efsdp``
and of everything else over ``fsdp``, and the auxiliary-loss-free load balancing its model
spec registers (``register_moe_load_balancing_hook``: the expert-bias update, an optimizer
step pre-hook, from token counts all-reduced over the loss mesh, and with tp over tp). Its
serial twin is the same MoE model with every degree 1. Besides the parameters and gradients,
each MoE layer's ``expert_bias_E`` buffer is compared, as the optimizer step begins (just
updated from that step's counts) and after the last step. ``step(config, experts=True)`` runs
the MoE model with any layout: with ep=1 and tp > 1, torchtitan 0.3.0 (which has no etp
degree) shards each expert's hidden dimension over tp, its expert tensor parallelism.

Two choices keep the comparison exact, and neither changes what is checked:

* the model is built and ``init_weights``-ed on CPU in full, then parallelized, so every rank
  and the twin start from the same weights (torchtitan's own meta-device path initialises
  DTensor shards from an RNG stream that depends on the rank count on CPU);
* each rank takes its rows of the global batch as torchtitan's loader would: the
  ``batch`` mesh's size and local rank pick the rows.

A layout with pipeline parallelism (``pp > 1``, with FSDP or TP) runs the trainer's pp path:
llama3's ``pipeline_llm`` cuts the model into stages, parallelizes each and builds the schedule
from ``pipeline_parallel_schedule`` (the debug config's ``Interleaved1F1B`` unless
``step(config, schedule=...)`` names another); ``train_step``'s pp branch runs it over
microbatches of one row, each loss divided by the step's global valid-token count, the loss
on the last stage; ``clip_grad_norm_`` reduces the norm over ``pp_mesh``; the optimizer runs
over every model part. Each rank records its stages' parameters under the full model's names.
:mod:`meshsim.own_steps.torchtitan_pp` holds that path and says what it replaces.

torchtitan's accelerator-only pieces are replaced by CPU computations of the same numbers
(:mod:`meshsim.own_steps.torchtitan_cpu` says each and why). ``before``, when given, runs on
each rank (and in the twin) before anything is built: tests plant bugs there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from meshsim.errors import UsageError

GLOBAL_BATCH = 8  # rows: splits over a batch mesh of 1, 2, 4 or 8 ranks
SEQUENCE = 64
#: torch's FlexAttention context parallelism shards the sequence in blocks of 128 tokens per
#: cp rank (``_create_cp_block_mask``), so a layout with cp > 1 trains on cp * 128 tokens.
CP_BLOCK = 128
LONGEST = 1024  # the batch's row length: cp up to 8
VOCABULARY = 2048  # the llama3 and deepseek_v3 debug models' vocab_size
#: deepseek_v3's debugmodel keeps its first two layers: the dense one and the first MoE one.
#: Its other four MoE layers run the same code again at three times the CPU time and memory,
#: which at world 8 on a 2-core machine is the difference between a minute and the OOM killer.
MOE_LAYERS = 2
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
#: torchtitan's ``ParallelismConfig`` field -> the ``ParallelDims`` attribute holding it.
PARALLELISM_FIELDS = {
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "context_parallel_degree": "cp",
    "tensor_parallel_degree": "tp",
    "pipeline_parallel_degree": "pp",
    "expert_parallel_degree": "ep",
    "spmd_backend": "spmd_backend",
}

WHAT_RUNS = (
    "torchtitan's own debug-model step: the llama3 model through parallelize_llama, or with "
    "ep>1 the deepseek_v3 MoE model through parallelize_deepseekv3 (EP all-to-all, experts' "
    "FSDP over efsdp, load-balancing bias update); inputs split over cp by "
    "prepare_context_parallel_input; with pp>1 pipeline_llm's stages (each parallelized) "
    "and its pipeline schedule over microbatches; ChunkedLossWrapper loss over the global "
    "valid-token count, clip_grad_norm_ (with pp_mesh), AdamW over every model part"
)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    if config.get("version", "current") != "current":
        version = config["version"]
        return f"torchtitan's own step runs torchtitan 0.3.0 (version 'current'), not {version!r}"
    if int(config.get("pp", 1)) > 1:
        from meshsim.own_steps import torchtitan_pp

        moe_layers = MOE_LAYERS if uses_experts(config) else None
        reason = torchtitan_pp.refusal(world_size, config, moe_layers)
        if reason is not None:
            return reason
    cp = int(config.get("cp", 1))
    if cp > 1 and sequence_length(config) > LONGEST:
        return f"torchtitan's own step with cp={cp}: its batch rows hold {LONGEST} tokens"
    if config.get("etp") not in (None, 1):
        return (
            "torchtitan 0.3.0 (version 'current') has no expert tensor-parallel degree: with "
            "ep>1 its experts are sharded over the ep mesh, which borrows tp's ranks (give ep "
            "with tp, e.g. tp=2 ep=2), and with ep=1 they are tensor-parallel over tp (the "
            "step runs the MoE model there with meshsim.own_steps.torchtitan.step(config, "
            "experts=True)); leave etp out"
        )
    return _spmd_types_refusal(world_size, config) or _full_dtensor_refusal(world_size, config)


def _full_dtensor_refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """``full_dtensor`` on a dense storage mesh of three or more dims: torch's DTensor expands
    every combination of each op's sharding strategies over the mesh in Python when FSDP's
    ``_StridedShard`` placements are among its inputs (its Dijkstra search, pytorch PRs
    169438 and 175999, returns None for those and falls back to that expansion, by design),
    on every op of every rank. Measured at world 8 on 2 cores: EP+CP+TP
    and HSDP+CP each ran past 15 minutes without ending, with the ranks' stacks in
    ``expand_to_full_mesh_op_strategy``; the same layouts with ``partial_dtensor`` take one to
    two minutes, and 2-D ``full_dtensor`` meshes run. A GPU host pays the same Python cost."""
    if (config.get("spmd_backend") or "spmd_types") != "full_dtensor":
        return None
    sizes = {d: int(config.get(d, 1)) for d in ("dp_replicate", "cp", "tp", "pp")}
    shard = int(config.get("dp_shard", -1))
    if shard == -1:
        shard = world_size // max(
            1, sizes["dp_replicate"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
        )
    dims = [d for d, n in {**sizes, "dp_shard": shard}.items() if d != "pp" and n > 1]
    if len(dims) < 3:
        return None
    return (
        f"torchtitan's own step with spmd_backend='full_dtensor' over {len(dims)} mesh dims "
        f"({', '.join(sorted(dims))}): torch's DTensor sharding propagation expands every "
        "strategy combination in Python for FSDP's _StridedShard parameters, on every op "
        "(a world-8 step ran past 15 minutes on 2 cores, computing, not hung); the step runs "
        "partial_dtensor on this mesh, or full_dtensor on two dims"
    )


def _spmd_types_refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """torchtitan 0.3.0's default ``spmd_backend='spmd_types'`` hands ``fully_shard`` plain
    parameters annotated with spmd_types; torch's FSDP2 learned to take those in 2.15
    (pytorch#187394). Earlier, ``fully_shard`` raises "all parameters must be DTensors on the
    full SPMD mesh" for any mesh of more than one rank: a real run on this torch fails so too."""
    from meshsim.torch_private import torch_version

    backend = config.get("spmd_backend") or "spmd_types"
    if backend != "spmd_types" or world_size == 1 or torch_version() >= (2, 15):
        return None
    version = ".".join(map(str, torch_version()))
    return (
        f"torchtitan 0.3.0's spmd_backend='spmd_types' (its default) needs torch >= 2.15: "
        f"torch {version}'s fully_shard raises 'all parameters must be DTensors on the full "
        "SPMD mesh' for its plain, annotated parameters (pytorch/pytorch#187394 added them); "
        "use --spmd-backend partial_dtensor or full_dtensor, or torch 2.15"
    )


def sequence_length(config: Mapping[str, Any]) -> int:
    """The tokens a row trains on: ``SEQUENCE``, or with cp > 1 the ``cp * CP_BLOCK`` torch's
    FlexAttention context parallelism needs (the serial twin uses the same length)."""
    cp = int(config.get("cp", 1))
    return SEQUENCE if cp == 1 else cp * CP_BLOCK


def uses_experts(config: Mapping[str, Any]) -> bool:
    """Whether the layout runs the MoE debug model: when it asks for expert parallelism. The
    serial twin of such a layout runs the same MoE model with every degree 1."""
    return int(config.get("ep", 1)) > 1


def _trainer_config(moe: bool) -> Any:
    """torchtitan's own debug trainer config: llama3's (dense) or deepseek_v3's (MoE)."""
    if moe:
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        return deepseek_v3_debugmodel()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return llama3_debugmodel()


def _expert_biases(model: Any) -> dict[str, Any]:
    """Each MoE layer's load-balancing bias (a buffer, so not among the parameters):
    torchtitan updates it before each optimizer step from the token counts summed over the
    loss mesh (and, with EP, over tp). Empty for a dense model."""
    from meshsim.usage.step import plain_name

    return {
        plain_name(name): buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name.endswith("expert_bias_E")
    }


def batch(step: int) -> Any:
    """A step's global batch: token ids, inputs and labels shifted by one (the step trains on
    the first ``sequence_length(config) + 1`` of each row)."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, LONGEST + 1), dtype=torch.int64)


def step(
    config: Mapping[str, Any],
    before: Callable[[], None] | None = None,
    *,
    experts: bool | None = None,
    schedule: str | None = None,
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`. ``experts`` picks the
    model: None runs the MoE model exactly when ``ep > 1``; True runs it with any layout (with
    ep=1 and tp > 1 torchtitan shards the experts' hidden dimension over tp instead).
    ``schedule`` is torchtitan's ``pipeline_parallel_schedule`` for a layout with pp > 1
    (None: its debug config's own, ``Interleaved1F1B``)."""
    return functools.partial(_step, dict(config), before, experts, schedule)


def _prepare(
    model: Any, parallel_dims: Any, par: Any, inputs: Any, labels: Any, positions: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """The trainer's ``post_dataloading_process`` of a batch (with pp, of each microbatch):
    attention masks from the positions, the cp split with the configured load balancer, the
    inputs as the spmd backend takes them."""
    import torch
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    extra: dict[str, Any] = {"positions": positions}
    extra["attention_masks"] = model.get_attention_masks(positions=positions)
    if parallel_dims.cp_enabled:
        inputs, labels, extra = prepare_context_parallel_input(
            inputs,
            labels,
            extra,
            parallel_dims.get_mesh("cp"),
            torch.device("cpu"),
            par.context_parallel_load_balancer,
            par.context_parallel_ptrr_mask_key,
        )
    if par.spmd_backend == "full_dtensor":
        inputs, labels, extra = full_dtensor.parallelize_inputs(
            parallel_dims, inputs, labels, extra
        )
    elif par.spmd_backend == "spmd_types":
        inputs, labels, extra = annotate_input_spmd_types(parallel_dims, inputs, labels, extra)
    return inputs, labels, extra


def _step(
    config: dict[str, Any],
    before: Callable[[], None] | None,
    experts: bool | None,
    schedule: str | None,
    ctx: Any,
) -> Any:
    import torch

    from meshsim.builders.real import torchtitan as adapter
    from meshsim.builders.real._shims import register_fake_backend
    from meshsim.own_steps import torchtitan_cpu as cpu

    cpu.stub_triton_kernels()
    cpu.cpu_device()
    cpu.eager_attention()
    cpu.eager_cp_block_mask()
    cpu.float32_experts()
    cpu.quiet()
    register_fake_backend()
    if before is not None:
        before()

    import spmd_types
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    from meshsim.own_steps import torchtitan_pp as pipelining

    moe = uses_experts(config) if experts is None else experts
    dims_config = {**config, **dict.fromkeys(DEGREES, 1)} if ctx.serial else config
    parallel_dims = adapter.parallel_dims(ctx.world_size, dims_config)
    parallel_dims.build_mesh()
    trainer = _trainer_config(moe)
    par = trainer.parallelism
    # The trainer's parallelism config, as ParallelDims resolved it (a -1 degree inferred).
    for field, dim in PARALLELISM_FIELDS.items():
        setattr(par, field, getattr(parallel_dims, dim))
    if schedule is not None:
        par.pipeline_parallel_schedule = schedule
    seq = sequence_length(config)
    trainer.training.seq_len = seq
    trainer.training.mixed_precision_param = "float32"  # compared in float32, not bfloat16
    trainer.training.dtype = "float32"
    dist_utils.set_spmd_backend(par.spmd_backend)

    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        batch_size, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_mesh, batch_size, batch_rank = None, 1, 0
    if GLOBAL_BATCH % batch_size:
        raise UsageError(
            f"torchtitan's own step: a global batch of {GLOBAL_BATCH} rows does not split over "
            f"a batch mesh of {batch_size} ranks"
        )
    rows = GLOBAL_BATCH // batch_size
    trainer.training.local_batch_size = rows

    model_config = trainer.model_spec.model
    if moe:
        model_config.layers = model_config.layers[:MOE_LAYERS]
    model_config.update_from_config(config=trainer)
    torch.manual_seed(ctx.seed)
    with torch.device("cpu"), utils.set_default_dtype(torch.float32):
        model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    loss_fn = trainer.loss.build(compile_config=trainer.compile)
    pipeline = None
    if parallel_dims.pp_enabled:  # torchtitan's stages and schedule (torchtitan_pp)
        pipeline = pipelining.build(trainer, model, parallel_dims, loss_fn)
        parts = pipeline.parts
    else:
        parts = [
            trainer.model_spec.parallelize_fn(
                model,
                parallel_dims=parallel_dims,
                training=trainer.training,
                parallelism=par,
                compile_config=trainer.compile,
                ac_config=trainer.activation_checkpoint,
                dump_folder=trainer.dump_folder,
            )
        ]
    for part in parts:
        part.train()
        cpu.sum_reduction(part)
    # With pp only the last stage holds lm_head; this rank's stages are recorded as one model.
    last_stage = pipeline is None or pipeline.last
    model = parts[0] if pipeline is None else pipelining.Stages(parts)

    if isinstance(loss_fn, ChunkedLossWrapper) and last_stage:
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    optimizers = trainer.optimizer.build(model_parts=parts)
    if trainer.model_spec.post_optimizer_build_fn is not None:
        # The MoE models' expert-bias update (auxiliary-loss-free load balancing), an
        # optimizer step pre-hook, exactly as torchtitan's trainer registers it.
        trainer.model_spec.post_optimizer_build_fn(optimizers, parts, parallel_dims)
    # The step is recorded as the optimizer step begins, after that hook: the expert biases
    # it has just updated from this step's token counts, no parameter moved yet.
    logged_values: dict[str, Any] = {}
    optimizers.register_step_pre_hook(
        lambda *_: ctx.record(model, **logged_values, **_expert_biases(model))
    )
    schedulers = trainer.lr_scheduler.build(
        optimizers=optimizers, training_steps=trainer.training.steps
    )
    context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims,
        spmd_typechecking=par.spmd_backend == "spmd_types" and trainer.debug.spmd_typechecking,
    )
    for i in range(ctx.steps):
        optimizers.zero_grad()
        tokens = ctx.batch(i)[batch_rank * rows : (batch_rank + 1) * rows, : seq + 1]
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = torch.arange(seq, dtype=torch.int64).expand(rows, seq).contiguous()
        # Counted before the cp split, as torchtitan's trainer counts its loader's rows.
        valid = (labels != IGNORE_INDEX).sum()
        if batch_mesh is not None:
            valid = dist_utils.dist_sum_tensor(valid, batch_mesh)
        prepare = functools.partial(_prepare, parts[0], parallel_dims, par)
        if pipeline is not None:  # train_step's pp branch
            microbatch = par.pipeline_parallel_microbatch_size
            loss = pipelining.forward_backward(
                pipeline, prepare, microbatch, inputs, labels, positions, valid, context
            )
        else:
            inputs, labels, extra = prepare(inputs, labels, positions)
            with context():
                pred = parts[0](inputs, **extra)
                loss, _ = loss_fn(pred, labels, valid, positions=extra["positions"])
                with spmd_types.no_typecheck():
                    loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for part in parts for p in part.parameters()],
            trainer.training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        # The trainer logs the loss summed over the loss mesh, as a float computed in float32.
        logged = loss.detach()
        if parallel_dims.dp_cp_enabled:
            logged = dist_utils.dist_sum(logged, parallel_dims.get_optional_mesh("loss"))
        if last_stage:  # with pp the other stages hold torchtitan's -1
            logged_values.update(loss=torch.tensor(float(logged), dtype=torch.float32))
        logged_values.update(grad_norm=grad_norm)
        optimizers.step()  # records the step (the hook above), then updates
        schedulers.step()
    if not moe:
        return model
    # The final parameters and the expert biases after the last update.
    return {**dict(model.named_parameters()), **_expert_biases(model)}
