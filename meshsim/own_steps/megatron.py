"""megatron-core 0.16.1's own training step, on N gloo ranks and alone, for the equivalence check.

What runs is what Megatron-LM's ``pretrain_gpt.py`` / ``training.train_step`` run per step, with
megatron-core's own objects: ``parallel_state.initialize_model_parallel`` (meshsim's megatron
config keys are its arguments); a tiny ``GPTModel`` (2 layers, or one per pipeline stage;
hidden 64, 8 heads, vocab 256, sequence 32, learned positions, tied embeddings, biases) from
the local (non-TransformerEngine) layer spec ``get_gpt_layer_local_spec``; MoE layers where
the layout has expert parallelism (8 experts in ``SequentialMLP``, top-2 router with its
load-balancing loss, all-gather dispatcher, no biases: see below); megatron's
``DistributedDataParallel`` and ``DistributedDataParallelConfig``; ``get_megatron_optimizer``
(Adam, ``clip_grad`` 0.5, which clips here; plain or ``use_distributed_optimizer``, partial
with several instances) and ``OptimizerParamScheduler`` (cosine). Per step:
``zero_grad_buffer``, ``get_forward_backward_func()`` (``forward_backward_no_pipelining``, or
the 1F1B schedule under pp) over micro-batches of 1 row, with ``finalize_model_grads``,
``no_sync`` and ``grad_scale_func`` wired into the model config as Megatron-LM wires them;
``optimizer.step()``; the scheduler's step. The serial twin is the same model config with
every degree 1, on one rank. ``step(..., sequence_parallel=, distributed_optimizer=, moe=)``
picks a variant (defaults: sequence parallelism where tp > 1, the distributed optimizer only
with several instances, MoE where the layout has ep or an expert tp).

The loss is what Megatron-LM's ``pretrain_gpt.loss_func`` returns for the model's per-token
cross entropy (megatron-core has none of its own: ``GPTModel`` returns per-token losses, the
schedule divides by the micro-batch's token count and the number of micro-batches, DDP scales
gradients by ``1 / dp_cp`` size): the masked sum, its token count and the ``[sum, count]``
report. The logged loss is what ``training.train_step`` logs: the reports summed over
micro-batches, all-reduced over the data-parallel group with context parallelism, sum /
count, on the last pipeline stage. ``grad_norm`` is what ``optimizer.step()`` returns. Each
rank takes its micro-batches' rows of the global batch as ``MegatronPretrainingSampler`` deals
them (a micro-batch of ``dp`` consecutive rows, one per data-parallel rank, by
``parallel_state.get_data_parallel_rank()``); tensor-parallel peers take the same rows.

``ctx.record`` runs inside ``optimizer.step()`` (``ChainedOptimizer.step``) once it has the
norm of the reduced gradients (``get_grad_norm``), before it clips them and updates: the
gradients compared are the reduced ones, so a wrong reduction is named at its parameter
rather than hidden by clipping's rescaling of every gradient, and a wrong clipping norm shows
in the logged ``grad_norm`` and the updated parameters. Each parameter is recorded as a
stand-in: its value (a view of it), the gradient the optimizer uses and megatron's marks
(``tensor_model_parallel``, ``partition_dim``, ``allreduce``, ``sequence_parallel``,
``shared``), under its global name (layers and experts by their global index, the last
stage's tied output weight as the embedding). The gradient is ``param.main_grad`` (a view of
DDP's grad buffer, also what the trace matches reductions against); under the distributed
optimizer only the rank's shard of it is reduced, so the shards are all-gathered over the
bucket's reduce-scatter group into a copy, for the record only. An expert parameter sliced
over an expert tp group other than the dense tp group is recorded whole, gathered over it
(a copy), as meshsim places tensor-parallel slices by the dense tp group.

Identical initial weights: with ``use_cpu_initialization=True`` megatron builds each weight
whole from the CPU generator and keeps the rank's tensor-parallel slice, so TP / DP ranks
and the twin start alike (the check compares them). A rank that builds only some layers
(pp) or experts (ep) draws other numbers; there the model is first built with every degree
1 (megatron's own init: the twin's weights) and each rank copies its slice into its model.

CUDA on this path, and what stands in for it on the CPU (each changing no number the check
compares), are in :mod:`meshsim.own_steps.megatron_cpu`.

Refused: context parallelism (the local spec's ``DotProductAttention`` asserts
``context_parallel_size == 1``: "Context parallelism is only supported by
TEDotProductAttention!", and TransformerEngine needs CUDA), hierarchical / hybrid CP (they
need CP), the interleaved pipeline schedule (virtual pp: not built here) and a
``hyper_comm_grid`` (groups built beside, which no step uses). A world of more
than one rank on any backend but gloo is refused in the step: ``parallel_state`` is
process-global, so threaded ranks would share one rank's groups. ``before``, when given, runs
on each rank and in the twin before anything is built (tests plant bugs there); if it
returns a callable, that is called when the step ends, so a warm gloo worker does not keep
a planted bug.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from meshsim.own_steps import megatron_cpu

GLOBAL_BATCH = 8  # rows: splits over a data-parallel group of 1, 2, 4 or 8 ranks
SEQUENCE = 32
VOCABULARY = 256
HIDDEN = 64
HEADS = 8
EXPERTS = 8  # ep of 1, 2, 4 or 8
EXPERT_HIDDEN = 128
#: Rows per micro-batch, the same on N ranks and in the twin: MoE's load-balancing loss is
#: computed per micro-batch, so a different micro-batch would be a different loss.
MICROBATCH_ROWS = 1
CLIP_GRAD = 0.5
LEARNING_RATE = 1e-3

WHAT_RUNS = (
    "megatron-core's own GPTModel step (local layer spec): its DistributedDataParallel, "
    "get_forward_backward_func schedule with finalize_model_grads, Megatron-LM's per-token "
    "loss and dp-cp loss logging, get_megatron_optimizer (Adam, clip_grad, plain or "
    "distributed) and OptimizerParamScheduler"
)

#: meshsim config keys the step passes to ``initialize_model_parallel`` (megatron's names).
PASSED = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_distributed_optimizer_instances",
    "order",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "create_gloo_process_groups",
    "create_all_gather_group",
)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    for key, why in (
        (
            "context_parallel_size",
            "the local layer spec's DotProductAttention asserts context_parallel_size == 1 "
            "('Context parallelism is only supported by TEDotProductAttention!'); "
            "TransformerEngine's attention needs CUDA",
        ),
        (
            "virtual_pipeline_model_parallel_size",
            "the interleaved pipeline schedule (model chunks per rank) is not run by this step",
        ),
        ("hierarchical_context_parallel_sizes", "it needs context parallelism (refused)"),
    ):
        value = config.get(key)
        if value not in (None, 1, [], ()):
            return f"megatron-core's own step with {key}={value}: {why}"
    if config.get("hybrid_context_parallel"):
        return (
            "megatron-core's own step with hybrid_context_parallel: it needs context "
            "parallelism (refused)"
        )
    if config.get("hyper_comm_grid"):
        return "megatron-core's own step does not use a hyper_comm_grid: leave it out"
    tp = int(config.get("tensor_model_parallel_size") or 1)
    if HEADS % tp or VOCABULARY % tp or SEQUENCE % tp:
        return (
            f"megatron-core's own step: tp={tp} does not divide its {HEADS} attention heads, "
            f"vocabulary of {VOCABULARY} and sequence of {SEQUENCE}"
        )
    ep = int(config.get("expert_model_parallel_size") or 1)
    if EXPERTS % ep:
        return f"megatron-core's own step: ep={ep} does not divide its {EXPERTS} experts"
    return None


def batch(step: int) -> Any:
    """A step's global batch: token ids, ``SEQUENCE + 1`` per row (inputs and labels)."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE + 1), dtype=torch.int64)


def step(
    config: Mapping[str, Any],
    before: Callable[[], Any] | None = None,
    *,
    sequence_parallel: bool | None = None,
    distributed_optimizer: bool | None = None,
    moe: bool | None = None,
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`.

    ``sequence_parallel`` (default: on where tp > 1, as Megatron-LM runs TP and as it needs for
    MoE), ``distributed_optimizer`` (default: only where the config has several
    distributed-optimizer instances, which need it) and ``moe`` (default: where the config
    has ep > 1 or an expert tp) pick the variant; the serial twin runs the same variant with
    every degree 1 (no sequence parallelism, the same experts). MoE with tp > 1 and no
    sequence parallelism raises UsageError: megatron refuses it.
    """
    tp = int(config.get("tensor_model_parallel_size") or 1)
    ep = int(config.get("expert_model_parallel_size") or 1)
    instances = int(config.get("num_distributed_optimizer_instances") or 1)
    options = {
        "sequence_parallel": tp > 1 if sequence_parallel is None else bool(sequence_parallel),
        "distributed_optimizer": (
            instances > 1 if distributed_optimizer is None else bool(distributed_optimizer)
        ),
        "moe": (
            ep > 1 or config.get("expert_tensor_parallel_size") is not None
            if moe is None
            else bool(moe)
        ),
    }
    if options["moe"] and tp > 1 and not options["sequence_parallel"]:
        from meshsim.errors import UsageError

        raise UsageError(
            "megatron-core refuses MoE with tensor parallelism but no sequence parallelism "
            "(TransformerConfig raises 'During training, performance may degrade if MoE and "
            "tensor parallelism are enabled without also enabling sequence parallelism')"
        )
    return functools.partial(_step, dict(config), before, options)


# -- the step --------------------------------------------------------------------------------
def _step(
    config: dict[str, Any],
    before: Callable[[], Any] | None,
    options: dict[str, bool],
    ctx: Any,
) -> Any:
    import warnings

    import torch.distributed as dist

    from meshsim.builders.real import _shims
    from meshsim.errors import UsageError

    backend = str(dist.get_backend())
    if not ctx.serial and backend != "gloo":
        raise UsageError(
            f"megatron-core's own step runs its ranks on backend 'gloo' (processes), not "
            f"{backend!r}: megatron's parallel_state is process-global, so ranks sharing a "
            "process would share one rank's groups"
            + ("" if backend == "threaded" else "; and it runs megatron on the CPU")
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        _shims.load(
            "megatron.core.parallel_state",
            "megatron.core.models.gpt",
            "megatron.core.distributed",
            "megatron.core.optimizer",
            "megatron.core.pipeline_parallel",
        )
    undo = before() if before is not None else None
    try:
        with (
            _shims.unchanged_environ(),
            _shims.megatron_clean_state() as ps,
            _fresh_moe_loss_tracker(),
            megatron_cpu.router_gemm_fallback(),
            megatron_cpu.cuda_as_cpu(),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            return _train(config, options, ps, ctx)
    finally:
        if callable(undo):
            undo()


@contextlib.contextmanager
def _fresh_moe_loss_tracker() -> Iterator[None]:
    """megatron's MoE routers log their auxiliary losses into a process-global tracker sized by
    the first model's layer count. Megatron-LM trains one model per process; here one process
    runs many steps (the serial twins of a sweep, a warm gloo worker), and a 4-layer model
    after a 2-layer one indexed past the end ("index 2 is out of bounds for dimension 0 with
    size 2"), so each step starts and ends with an empty tracker."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    try:
        yield
    finally:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _degrees(config: Mapping[str, Any], serial: bool) -> dict[str, Any]:
    """``initialize_model_parallel`` keyword arguments (none for the twin)."""
    if serial:
        return {}
    return {key: config[key] for key in PASSED if config.get(key) is not None}


def _model_config(kwargs: Mapping[str, Any], options: Mapping[str, bool], layers: int) -> Any:
    import torch
    from megatron.core.transformer import TransformerConfig

    tp = int(kwargs.get("tensor_model_parallel_size") or 1)
    moe: dict[str, Any] = {}
    if options["moe"]:
        # No biases: megatron-core 0.16.1's expert MLP adds its bias in place
        # (``output += output_bias...``, mlp.py) to the output of
        # ``reduce_from_tensor_model_parallel_region``, which with expert tp and ep of 1 (the
        # serial twin) is its input returned as-is: autograd raises "a view ... is being
        # modified inplace".
        moe = {
            "num_moe_experts": EXPERTS,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": EXPERT_HIDDEN,
            "moe_grouped_gemm": False,
            "moe_aux_loss_coeff": 1e-2,  # the load-balancing loss, with its own reductions
            "add_bias_linear": False,
        }
    return TransformerConfig(
        num_layers=layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=int(kwargs.get("pipeline_model_parallel_size") or 1),
        expert_model_parallel_size=int(kwargs.get("expert_model_parallel_size") or 1),
        expert_tensor_parallel_size=kwargs.get("expert_tensor_parallel_size"),
        sequence_parallel=options["sequence_parallel"] and tp > 1,
        calculate_per_token_loss=False,  # Megatron-LM's default
        # pp: no torch.cuda.synchronize() after batch_isend_irecv (a work-around for old
        # PyTorch on CUDA streams); the schedule wait()s on every request before it.
        batch_p2p_sync=False,
        **moe,
    )


def _gpt(model_config: Any, options: Mapping[str, bool], ps: Any, seed: int) -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS if options["moe"] else None, moe_grouped_gemm=False
    )
    if model_config.sequence_parallel:
        spec = megatron_cpu.with_marked_norms(spec, model_config)
    return GPTModel(
        config=model_config,
        transformer_layer_spec=spec,
        vocab_size=VOCABULARY,
        max_sequence_length=SEQUENCE,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )


def _global_names(model: Any) -> dict[str, tuple[str, Any]]:
    """Megatron parameter name -> (the name the twin gives it, the parameter): layers by
    their global number, experts by their global index, the last stage's copy of the tied
    embedding (pp) under the embedding's name."""
    names: dict[str, str] = {}
    for i, layer in enumerate(getattr(model.decoder, "layers", ())):
        names[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
        experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if experts is not None and indices is not None:
            for j, index in enumerate(indices):
                names[f"decoder.layers.{i}.mlp.experts.local_experts.{j}."] = (
                    f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{index}."
                )
    out: dict[str, tuple[str, Any]] = {}
    for name, param in model.named_parameters():
        renamed = name
        for prefix in sorted(names, key=len, reverse=True):
            if name.startswith(prefix):
                renamed = names[prefix] + name[len(prefix) :]
                break
        if renamed == "output_layer.weight" and not model.pre_process:
            renamed = "embedding.word_embeddings.weight"
        out[name] = (renamed, param)
    return out


def _expert_parameters(model: Any) -> set[int]:
    """``id`` of every expert parameter: those of megatron's linear layers built with
    ``is_expert`` (their ``allreduce`` mark is False only under ep > 1)."""
    return {
        id(param)
        for module in model.modules()
        if getattr(module, "is_expert", False)
        for param in module.parameters(recurse=False)
    }


def _slice_of(full: Any, param: Any, expert: bool, ps: Any) -> Any:
    """This rank's slice of the whole tensor ``full``, as megatron's CPU init cuts it."""
    import torch

    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    size = (
        ps.get_expert_tensor_parallel_world_size()
        if expert
        else ps.get_tensor_model_parallel_world_size()
    )
    dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    chunks = torch.split(full, full.shape[dim] // size // stride, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def _copy_full_weights(model: Any, full: Mapping[str, Any], ps: Any) -> None:
    import torch

    experts = _expert_parameters(model)
    with torch.no_grad():
        for name, param in _global_names(model).values():
            param.copy_(_slice_of(full[name], param, id(param) in experts, ps))


def _train(config: dict[str, Any], options: dict[str, bool], ps: Any, ctx: Any) -> Any:
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from meshsim.errors import UsageError

    kwargs = _degrees(config, ctx.serial)
    pp = int(config.get("pipeline_model_parallel_size") or 1)
    ep = int(config.get("expert_model_parallel_size") or 1)
    layers = max(2, pp)
    full = None
    if not ctx.serial and (pp > 1 or ep > 1):
        # The twin's weights, by megatron's own CPU init with every degree 1, to slice from.
        ps.initialize_model_parallel(create_gloo_process_groups=False)
        whole = _gpt(_model_config({}, options, layers), options, ps, ctx.seed)
        full = {name: p.detach().clone() for name, p in _global_names(whole).values()}
        del whole
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**kwargs)
    model_config = _model_config(kwargs, options, layers)
    model = _gpt(model_config, options, ps, ctx.seed)
    if full is not None:
        _copy_full_weights(model, full, ps)

    dp_size = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    if GLOBAL_BATCH % dp_size:
        raise UsageError(
            f"megatron-core's own step: a global batch of {GLOBAL_BATCH} rows does not split "
            f"over {dp_size} data-parallel ranks"
        )
    rows = MICROBATCH_ROWS
    microbatches = GLOBAL_BATCH // (rows * dp_size)

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=options["distributed_optimizer"],
        overlap_grad_reduce=False,
        num_distributed_optimizer_instances=int(
            kwargs.get("num_distributed_optimizer_instances") or 1
        ),
    )
    ddp = DistributedDataParallel(config=model_config, ddp_config=ddp_config, module=model)
    # What Megatron-LM's training.setup_model_and_optimizer / train wire into the config.
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LEARNING_RATE,
            min_lr=LEARNING_RATE / 10,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=CLIP_GRAD,
            use_distributed_optimizer=options["distributed_optimizer"],
            params_dtype=torch.float32,
        ),
        [ddp],
        # As Megatron-LM passes --enable-gloo-process-groups to both.
        use_gloo_process_groups=kwargs.get("create_gloo_process_groups", True) is not False,
    )
    model_config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train(): 1 in fp32
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=LEARNING_RATE,
        min_lr=LEARNING_RATE / 10,
        lr_warmup_steps=0,
        lr_decay_steps=GLOBAL_BATCH * ctx.steps,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=GLOBAL_BATCH * ctx.steps,
        wd_incr_style="constant",
    )
    forward_backward = get_forward_backward_func()
    last_stage = ps.is_pipeline_last_stage()
    recorder = _Recorder(ddp, options["distributed_optimizer"], ps, ctx)
    recorder.attach(optimizer)

    try:
        for i in range(ctx.steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            tokens = ctx.batch(i)
            reports = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=_microbatches(tokens, dp_rank, dp_size, rows, microbatches),
                model=[ddp],
                num_microbatches=microbatches,
                seq_length=SEQUENCE,
                micro_batch_size=rows,
                forward_only=False,
            )
            recorder.loss = _logged_loss(reports, ps) if last_stage else None
            success, grad_norm, _ = optimizer.step()
            if not success or not recorder.recorded:
                raise RuntimeError("megatron's optimizer step did not reach its update")
            if grad_norm != recorder.grad_norm:
                raise RuntimeError("the recorded grad_norm is not what optimizer.step() returned")
            scheduler.step(increment=GLOBAL_BATCH)
        return recorder.parameters()
    finally:
        _cut_autograd_cycles(ddp)


def _cut_autograd_cycles(ddp: Any) -> None:
    """Let the model, and the process groups it holds, be freed once the step ends.

    megatron's DDP hangs a hook that holds the DDP itself on each parameter's grad
    accumulator, and its MoE token dispatchers keep the last forward's routing tensors, whose
    autograd graph ends in those accumulators. Each such cycle runs through autograd's C++
    nodes, which the garbage collector cannot see into, so it is never freed: Megatron-LM
    builds one model per process and never notices. A warm gloo worker runs step after step;
    the 17 groups each world-8 MoE step left alive (51 gloo threads) retired the worker
    within two or three steps, and most steps of a sweep paid a fresh worker's megatron
    import (16 to 20 s at world 8). Cutting the cycles changes nothing the step computed.
    """
    import torch

    def drop_graphs(owner: Any) -> None:
        for name, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(owner, name, None)

    ddp.grad_accs.clear()
    for module in ddp.modules():
        drop_graphs(module)
        for helper in vars(module).values():  # a token dispatcher is no module
            if hasattr(helper, "__dict__") and not isinstance(helper, (torch.nn.Module, type)):
                drop_graphs(helper)


def _microbatches(
    tokens: Any, dp_rank: int, dp_size: int, rows: int, microbatches: int
) -> Iterator[dict[str, Any]]:
    """This rank's micro-batches, as ``MegatronPretrainingSampler`` deals the rows out."""
    import torch

    for m in range(microbatches):
        start = (m * dp_size + dp_rank) * rows
        chunk = tokens[start : start + rows]
        yield {
            "tokens": chunk[:, :-1].contiguous(),
            "labels": chunk[:, 1:].contiguous(),
            "loss_mask": torch.ones(rows, SEQUENCE, dtype=torch.float32),
            "position_ids": torch.arange(SEQUENCE).expand(rows, SEQUENCE).contiguous(),
        }


def _forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """Megatron-LM's ``pretrain_gpt.forward_step``: the model's per-token losses and the loss
    function for them."""
    micro = next(data_iterator)
    output = model(
        micro["tokens"],
        micro["position_ids"],
        None,  # the local spec's attention applies its causal mask itself
        labels=micro["labels"],
        loss_mask=micro["loss_mask"],
    )
    return output, functools.partial(_loss, micro["loss_mask"])


def _loss(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron-LM's ``pretrain_gpt.loss_func``: the masked sum of the per-token losses, the
    token count, and ``[sum, count]`` for the log."""
    import torch

    per_token = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    total = torch.sum(per_token * mask)
    count = mask.sum().detach().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.to(total.dtype)])}


def _logged_loss(reports: list[dict[str, Any]], ps: Any) -> Any:
    """Megatron-LM's ``train_step`` log: the micro-batches' ``[sum, count]`` summed,
    all-reduced over dp-cp, sum / count."""
    import torch
    import torch.distributed as dist

    summed = torch.stack([r["lm loss"].view(-1) for r in reports]).sum(dim=0)
    dist.all_reduce(summed, group=ps.get_data_parallel_group(with_context_parallel=True))
    return summed[0] / summed[1]


class _Recorder:
    """Calls ``ctx.record`` inside ``optimizer.step()``, before it clips and updates."""

    ATTRIBUTES = (
        "tensor_model_parallel",
        "partition_dim",
        "partition_stride",
        "allreduce",
        "sequence_parallel",
        "shared",
        "shared_embedding",
    )

    def __init__(self, ddp: Any, distributed: bool, ps: Any, ctx: Any) -> None:
        self.ddp, self.distributed, self.ps, self.ctx = ddp, distributed, ps, ctx
        self.loss: Any = None
        self.grad_norm: Any = None
        self.recorded = False
        self.names = _global_names(ddp.module)
        self.experts = _expert_parameters(ddp.module)
        self.expert_tp_is_tp = self._expert_tp_is_tp()

    def _expert_tp_is_tp(self) -> bool:
        import torch.distributed as dist

        ps = self.ps
        dense = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        experts = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
        return list(dense) == list(experts)

    def attach(self, optimizer: Any) -> None:
        """Record where ``ChainedOptimizer.step`` has its gradients ready and their norm
        (``get_grad_norm``), before it clips them and updates."""
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        if not isinstance(optimizer, ChainedOptimizer):
            raise RuntimeError(
                f"get_megatron_optimizer returned a {type(optimizer).__name__}, not the "
                "ChainedOptimizer this step records in"
            )
        original = optimizer.get_grad_norm

        def get_grad_norm() -> Any:
            self.grad_norm = original()
            self.record()
            return self.grad_norm

        optimizer.get_grad_norm = get_grad_norm

    def record(self) -> None:
        import torch

        values: dict[str, Any] = {"grad_norm": torch.tensor(float(self.grad_norm))}
        if self.loss is not None:
            values["loss"] = self.loss.detach().clone()
        self.ctx.record(self.parameters(grads=self._grads()), **values)
        self.recorded = True

    def _grads(self) -> dict[Any, Any]:
        """Parameter -> the gradient the optimizer steps with (all of it, on every rank)."""
        import torch
        import torch.distributed as dist
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        if not self.distributed:
            return {p: p.main_grad for _, p in self.names.values()}
        groups = {}
        for group in [*self.ddp.bucket_groups, *self.ddp.expert_parallel_bucket_groups]:
            for bucket in group.buckets:
                groups[id(bucket)] = group
        grads: dict[Any, Any] = {}
        for buffer in [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]:
            whole: dict[int, tuple[int, Any]] = {}
            for bucket in buffer.buckets:
                group = groups[id(bucket)]
                size = group.intra_distributed_optimizer_instance_size
                rank = group.intra_distributed_optimizer_instance_rank
                gathered = torch.empty_like(bucket.grad_data)
                dist.all_gather_into_tensor(
                    gathered,
                    shard_buffer(bucket.grad_data, size)[rank],
                    group=group.intra_distributed_optimizer_instance_group,
                )
                whole[bucket.bucket_id] = (bucket.offset, gathered)
            # The buffer's own index (with the distributed optimizer's padding), not the
            # bucket's ``param_to_index``, which counts without it.
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                offset, gathered = whole[bucket_id]
                grads[param] = gathered[start - offset : end - offset].view(param.shape)
        return grads

    def parameters(self, grads: Mapping[Any, Any] | None = None) -> dict[str, Any]:
        """Global name -> a stand-in: the parameter's value (its storage), ``grad`` and
        ``main_grad`` (what the trace matches reductions against) and megatron's marks."""
        out: dict[str, Any] = {}
        for name, param in self.names.values():
            stand_in = param.detach()
            for attribute in self.ATTRIBUTES:
                if hasattr(param, attribute):
                    setattr(stand_in, attribute, getattr(param, attribute))
            grad = None if grads is None else grads[param]
            if id(param) in self.experts and not self.expert_tp_is_tp:
                # An expert tp other than the dense tp: recorded whole (gathered over it).
                stand_in, grad = self._whole_expert(param, stand_in, grad)
            if grad is not None:
                stand_in.grad = grad
                stand_in.main_grad = param.main_grad
            out[name] = stand_in
        return out

    def _whole_expert(self, param: Any, value: Any, grad: Any) -> tuple[Any, Any]:
        """An expert parameter's value and gradient gathered over the expert tp group (a
        copy for the record), marked as a whole tensor."""
        import torch
        import torch.distributed as dist

        group = self.ps.get_expert_tensor_parallel_group()
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            if int(getattr(param, "partition_stride", 1)) != 1:
                raise RuntimeError(f"a strided expert tp slice is not gathered: {param.shape}")
            dim = int(param.partition_dim)
            gathered = []
            for tensor in (value, grad):
                if tensor is None:
                    gathered.append(None)
                    continue
                parts = [torch.empty_like(tensor) for _ in range(group.size())]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                gathered.append(torch.cat(parts, dim=dim))
            value, grad = gathered
            for attribute in self.ATTRIBUTES:
                if hasattr(param, attribute):
                    setattr(value, attribute, getattr(param, attribute))
        value.tensor_model_parallel = False
        return value, grad
