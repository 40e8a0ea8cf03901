"""accelerate 1.15's own training step, on N ranks and alone, for the equivalence check.

What runs is an accelerate training loop with accelerate's own objects: ``Accelerator(
parallelism_config=ParallelismConfig(...), fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2, ...))``; ``accelerator.prepare(model, optimizer, data_loader, scheduler)``,
which applies its FSDP2 (``fsdp2_prepare_model``: ``fully_shard`` per ``LlamaDecoderLayer`` and
on the root, on the mesh ``fsdp_dim_names`` names, HSDP included), its DDP wrapper, or its
tensor-parallel preparation (``_prepare_tp``) of a model transformers sharded with the model's
own ``tp_plan``, and shards the data loader over the mesh's data-parallel ranks (TP and CP
peers load the same rows); with ``cp_size > 1`` it also prepares context parallelism
(``_prepare_cp``: the rotate method, torch's ``context_parallel`` on the mesh's ``cp`` dim, the
hooks that drop the attention mask for ``is_causal``), and FSDP2 shards over the flattened
``dp_shard_cp``. Then per step, forward and ``accelerator.backward`` (inside
``accelerator.maybe_context_parallel`` with cp, which shards the ids, labels and positions
along the sequence and makes SDPA ring attention over cp; see :func:`_forward_backward`),
``accelerator.reduce(loss, "mean")`` (the logged loss), ``accelerator.clip_grad_norm_`` (max
norm 0.5, which clips here), the AdamW step and the scheduler step (an
``AcceleratedScheduler``). Each row of the batch is packed as accelerate's CP example packs
its data: the model reads the first 32 tokens, and the labels are the row shifted by one
(``shift_labels``), so every position has a label and every cp rank as many. The model is a tiny
``LlamaForCausalLM`` (transformers 5.23, 2 layers, vocab 256), built in full on every rank from
``torch.manual_seed(ctx.seed)``; TP layouts hand its state dict to transformers'
``from_pretrained(distributed_config=DistributedConfig(tp_size=...))``, so every rank and the
twin start from the same weights. The loader runs with ``split_batches=True``: its batch is the
global batch and accelerate splits it over the data-parallel ranks (and steps the scheduler
once per step, as the serial twin does); ``dispatch_batches`` makes it accelerate's
``DataLoaderDispatcher`` (rank 0 loads and broadcasts). The serial twin is one process with no
``ParallelismConfig`` and no plugin, accelerate's ``DistributedType.NO``.

Three things stand in for a GPU launch, none changing what is compared:

* ``PartialState`` is filled from ``torch.distributed`` (the harness's group, its rank and
  size, device ``cpu``) instead of from launcher variables, with the distributed type a launch
  on GPUs gives (``MULTI_GPU``) for FSDP2 and TP layouts. accelerate 1.15 decides the type from
  the hardware: on a CPU its ``MULTI_CPU`` type drops the FSDP plugin (``AcceleratorState``
  enables FSDP only for accelerator types) and ``ParallelismConfig._validate_accelerator``
  refuses any ``ParallelismConfig`` larger than one rank. The type picks code paths only; the
  collectives, meshes and parameters are the ones the GPU job builds, on the CPU. DDP layouts
  run as accelerate's own ``MULTI_CPU`` job (no ``ParallelismConfig``, which that type refuses):
  the same ``DistributedDataParallel(model)`` over the world group, without ``device_ids``,
  which a CPU module requires (``MULTI_GPU`` passes ``[local_process_index]``).
* Threaded ranks are refused: ``PartialState``, ``AcceleratorState`` and ``GradientState`` keep
  their state in class-level dicts (``SharedDict`` is a plain ``dict`` without torch_xla), one per
  process, so ranks in threads of one process would share one ``process_index``. Use gloo. The
  singletons are reset before and after each run, so a warm gloo worker runs the next layout.
* With ``cp_size > 1``, CPU SDPA is routed to the attention op torch's CP handles
  (:mod:`meshsim.own_steps.accelerate_cpu` explains it): torch 2.13's context parallelism
  handles only the CUDA attention ops (flash, efficient, cuDNN); on a CPU, SDPA of its
  sequence-sharded DTensors reaches ``aten._scaled_dot_product_flash_attention_for_cpu`` and
  every rank raises ``NotImplementedError`` (no sharding strategy registered). The stand-in
  gives ``aten._scaled_dot_product_flash_attention`` (and its backward) CPU kernels that call
  the CPU flash kernels, so torch's own CP handler, sharding rules, load balancing and ring
  (forward, backward and the log-sum-exp merge) run unchanged; only each block's kernel is the
  CPU one, as the serial twin's is. The twin runs torch's SDPA as it is.

``before``, when given, runs on each rank (and in the twin) before anything is built: tests
plant bugs there. What it patches on accelerate's classes and modules (:data:`PATCHABLE`) is
put back after the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

GLOBAL_BATCH = 8  # rows: splits over 1, 2, 4 or 8 data-parallel ranks
SEQUENCE = 32
VOCABULARY = 256
MAX_GRAD_NORM = 0.5
#: ``DataLoaderConfiguration(split_batches=...)``: True, so the serial twin's loader and the
#: N-rank one yield the same global batches and the scheduler steps once per step. accelerate's
#: default (False) steps the scheduler ``num_processes`` times per step (see the tests).
SPLIT_BATCHES = True
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")

WHAT_RUNS = (
    "accelerate's own step: Accelerator(parallelism_config=..., fsdp_plugin=FSDP2).prepare "
    "(its fully_shard / DDP / TP / CP preparation and data-loader sharding) of a tiny "
    "transformers LlamaForCausalLM, maybe_context_parallel, accelerator.backward, reduce of the "
    "loss, clip_grad_norm_, AdamW"
)


def _size(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    return 1 if value is None else int(value)


def _kind(config: Mapping[str, Any]) -> str:
    """meshsim's default ``distributed_type`` (the convention's rule)."""
    kind = config.get("distributed_type")
    if kind is not None:
        return str(kind)
    if _size(config, "dp_shard_size") > 1 or _size(config, "cp_size") > 1:
        return "FSDP"
    if _size(config, "sp_size") > 1 or int(config.get("autotp_size") or 0) > 1:
        return "DEEPSPEED"
    return "MULTI_GPU"


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    from meshsim.builders.real.accelerate import installed_version

    head = "accelerate's own step"
    wanted, found = str(config.get("version") or installed_version()), installed_version()
    if wanted != found:
        return f"{head} runs the installed accelerate {found}, not version {wanted!r}"
    kind = _kind(config)
    if kind == "DEEPSPEED":
        return (
            f"{head} with distributed_type DEEPSPEED (sp_size / autotp_size): DeepSpeed's engine "
            "(ZeRO, ALST/Ulysses sequence parallelism, AutoTP) is not run"
        )
    if _size(config, "sp_size") > 1:
        return f"{head} with sp_size={config['sp_size']}: sequence parallelism is DeepSpeed's"
    shard, tp = _size(config, "dp_shard_size"), _size(config, "tp_size")
    replicate, cp = _size(config, "dp_replicate_size"), _size(config, "cp_size")
    if (tp > 1 or cp > 1) and replicate > 1 and shard == 1:
        return (
            f"{head}: accelerate 1.15's ParallelismConfig refuses tp_size / cp_size > 1 with "
            "pure dp_replicate_size > 1 (ValueError: TP and CP need dp_shard_size > 1 to "
            "compose with DP)"
        )
    if cp > 1 and SEQUENCE % cp:
        return (
            f"{head} with cp_size={cp}: the step's {SEQUENCE}-token rows do not split into "
            f"{cp} equal sequence shards (torch's context_parallel chunks them evenly)"
        )
    if cp > 1 and config.get("dispatch_batches"):
        return (
            f"{head} with dispatch_batches and cp_size={cp}: accelerate's DataLoaderDispatcher "
            "reads only the mesh's tp dim (submesh_tp) to hand peers the same rows, none for "
            "cp; not run"
        )
    if kind == "MULTI_GPU" and cp > 1:
        return (
            f"{head} with distributed_type MULTI_GPU and cp_size={cp}: accelerate 1.15 "
            "refuses context parallelism without the FSDP2 plugin (ValueError)"
        )
    if kind == "FSDP" and shard == 1 and cp == 1:
        return (
            f"{head}: FSDP with dp_shard_size=1 and cp_size=1 has no dimension to shard across "
            "(accelerate's _validate_accelerator raises ValueError)"
        )
    if kind == "MULTI_GPU" and shard > 1 and tp > 1:
        return (
            f"{head} with distributed_type MULTI_GPU, dp_shard_size={shard} and tp_size={tp}: "
            "without the FSDP2 plugin accelerate 1.15's prepare_model takes its TP branch and "
            "wraps nothing, so the dp_shard ranks' gradients are never averaged (the reference "
            "flags this layout); not run, since transformers' from_pretrained TP-shards over the "
            "whole world only"
        )
    if kind == "MULTI_GPU" and shard > 1:
        return (
            f"{head} with distributed_type MULTI_GPU and dp_shard_size={shard}: without the FSDP2 "
            "plugin accelerate wraps the model in DDP with device_ids=[local rank], which a CPU "
            "module refuses; not run (give distributed_type FSDP)"
        )
    if config.get("dispatch_batches") and tp > 1:
        return (
            f"{head} with dispatch_batches and tp_size={tp}: accelerate's DataLoaderDispatcher "
            "hands TP peers the same rows only without split_batches (with it, it slices the "
            "global batch over every process and warns), and without split_batches the "
            "scheduler steps num_processes times per step (see the tests); not run"
        )
    if kind == "FSDP" and tp > 1 and (reason := _fsdp_tp_refusal()) is not None:
        return f"{head} with FSDP2 and tp_size={tp}: {reason}"
    return None


def _fsdp_tp_refusal() -> str | None:
    """Why FSDP2 + TP does not run with the installed transformers (None: it may).

    accelerate 1.15's ``_prepare_tp`` imports ``ReplicateParallel`` from transformers under
    FSDP2 (to wrap the parameters TP left plain); transformers 5 removed it, so every rank
    raises ImportError. Before that, transformers 5's ``from_pretrained(distributed_config=
    DistributedConfig(tp_size=...))`` builds its own mesh over the whole world and raises
    RuntimeError unless ``tp_size`` is the world size (the ``device_mesh`` accelerate's example
    passes is no longer read)."""
    from meshsim.builders.real import _shims

    (tp,) = _shims.load("transformers.integrations.tensor_parallel")
    if hasattr(tp, "ReplicateParallel"):
        return None
    import transformers

    version = transformers.__version__
    return (
        "accelerate 1.15's Accelerator._prepare_tp imports ReplicateParallel from "
        f"transformers.integrations.tensor_parallel, which transformers {version} no longer has "
        "(ImportError on every rank); transformers' from_pretrained also builds its TP mesh over "
        "the whole world (RuntimeError: 'The parallel mesh requires <tp_size> processes')"
    )


def batch(step: int) -> Any:
    """A step's global batch: packed rows of ``SEQUENCE + 1`` token ids. The model reads the
    first ``SEQUENCE`` of each row; the labels are the row shifted by one (see
    :func:`_forward_backward`)."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE + 1), dtype=torch.int64)


def step(
    config: Mapping[str, Any], before: Callable[[], None] | None = None
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`."""
    return functools.partial(_step, dict(config), before)


def _model_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,  # so that a tensor-parallel group of 8 splits them
        num_key_value_heads=8,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )


def _reset_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _fill_state(kind: str, serial: bool) -> None:
    """``PartialState`` as accelerate's discovery fills it for this rank (see the module doc)."""
    import torch
    import torch.distributed as dist
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    rank = 0 if serial else dist.get_rank()
    PartialState._shared_state.update(
        {
            "_cpu": kind == "MULTI_CPU",
            "backend": None if serial else str(dist.get_backend()),
            "device": torch.device("cpu"),
            "debug": False,
            "distributed_type": DistributedType[kind],
            "num_processes": 1 if serial else dist.get_world_size(),
            "process_index": rank,
            "local_process_index": rank,
            "fork_launched": False,
        }
    )


def _accelerator(config: Mapping[str, Any], serial: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin

    dispatch = bool(config.get("dispatch_batches")) and not serial
    loader = DataLoaderConfiguration(split_batches=SPLIT_BATCHES, dispatch_batches=dispatch)
    kind = _kind(config)
    if serial:
        _fill_state("NO", serial)
        return Accelerator(dataloader_config=loader)
    if kind == "MULTI_GPU" and _size(config, "tp_size") == 1:
        _fill_state("MULTI_CPU", serial)  # DDP: accelerate's CPU job (see the module doc)
        return Accelerator(dataloader_config=loader)
    _fill_state("MULTI_GPU", serial)
    sizes = {k: int(config[k]) for k in SIZES if config.get(k) is not None}
    plugin = None
    if kind == "FSDP":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
        )
    return Accelerator(
        parallelism_config=ParallelismConfig(**sizes), fsdp_plugin=plugin, dataloader_config=loader
    )


def _model(accelerator: Any, seed: int) -> Any:
    """The tiny Llama in full from ``seed``; sharded by transformers' own TP plan under TP."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = _model_config()
    model = LlamaForCausalLM(config)
    parallelism = accelerator.parallelism_config
    if parallelism is None or not parallelism.tp_enabled:
        return model
    from transformers.distributed import DistributedConfig

    return LlamaForCausalLM.from_pretrained(
        None,
        config=config,
        state_dict=model.state_dict(),
        distributed_config=DistributedConfig(tp_size=parallelism.tp_size),
        dtype=torch.float32,
    )


def _data_parallel_size(accelerator: Any) -> int:
    """The ranks loading different rows: the mesh's dp dims, every process without a mesh."""
    parallelism = accelerator.parallelism_config
    if parallelism is None:
        return int(accelerator.num_processes)
    return int(parallelism.data_parallel_size)


def _step(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch.distributed as dist

    from meshsim.builders.real import _shims
    from meshsim.errors import UsageError

    if not ctx.serial and ctx.world_size > 1 and str(dist.get_backend()) == "threaded":
        raise UsageError(
            "accelerate's own step cannot run on threaded ranks: accelerate keeps PartialState, "
            "AcceleratorState and GradientState in process-wide singletons (class-level dicts), "
            "so ranks in threads of one process would share one process_index and one "
            "distributed type; use --backend gloo"
        )
    with _shims.unchanged_environ():  # Accelerator sets ACCELERATE_USE_FSDP
        _shims.load("accelerate", "transformers")
        _reset_state()
        try:
            with _put_back(before), _cpu_stand_ins(config, ctx):
                return _train(config, before, ctx)
        finally:
            _reset_state()


#: What a ``before`` hook may patch: put back after the run (a warm gloo worker runs the next
#: layout, and the twin runs in the caller's process).
PATCHABLE = (
    "accelerate.accelerator:Accelerator",
    "accelerate.parallelism_config:ParallelismConfig",
    "accelerate.scheduler:AcceleratedScheduler",
    "accelerate.data_loader",
    "accelerate.utils.fsdp_utils",
    "accelerate.utils.operations",
    "meshsim.own_steps.accelerate",
    "torch.nn.functional",  # its scaled_dot_product_attention, under CP
)


def _cpu_stand_ins(config: Mapping[str, Any], ctx: Any) -> Any:
    """With cp > 1 on the N ranks: CPU SDPA routed to torch's CP ring attention
    (:mod:`meshsim.own_steps.accelerate_cpu`); nothing otherwise, and nothing in the twin."""
    import contextlib

    from meshsim.own_steps.accelerate_cpu import ring_attention_on_cpu

    if ctx.serial or _size(config, "cp_size") == 1:
        return contextlib.nullcontext()
    return ring_attention_on_cpu()


def _put_back(before: Callable[[], None] | None) -> Any:
    """Restore the attributes of :data:`PATCHABLE` that ``before`` (a planted bug) replaced."""
    from meshsim.own_steps import put_back

    return put_back(before, PATCHABLE)


def _train(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch
    from torch.utils.data import DataLoader

    from meshsim.dataflow import recipes

    recipes._quiet()
    _quiet_transformers()
    if before is not None:
        before()
    accelerator = _accelerator(config, ctx.serial)
    model = _model(accelerator, ctx.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # A warmup that tells every scheduler step apart (a step taken twice shows at step 2).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    rows = torch.cat([ctx.batch(i) for i in range(ctx.steps)])
    # split_batches: the loader's batch is the global batch, which accelerate splits; without
    # it each data-parallel rank loads batches of its own share.
    share = 1 if SPLIT_BATCHES else _data_parallel_size(accelerator)
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // share)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    logged: dict[str, Any] = {}

    def before_update(inner: Any, args: Any, kwargs: Any) -> None:
        ctx.record(model, loss=logged["loss"], grad_norm=logged["grad_norm"])

    optimizer.optimizer.register_step_pre_hook(before_update)
    model.train()
    for packed in loader:
        loss = _forward_backward(accelerator, model, packed)
        logged["loss"] = accelerator.reduce(loss.detach(), reduction="mean")
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        logged["grad_norm"] = norm.detach().clone()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model


def _forward_backward(accelerator: Any, model: Any, packed: Any) -> Any:
    """The loss of one batch of packed rows, and its backward, as accelerate's own CP example
    (``examples/torch_native_parallelism/nd_parallel.py``) computes them: the model reads the
    first ``SEQUENCE`` tokens of each row at positions ``0 .. SEQUENCE - 1``, and the labels are
    the row shifted by one, handed over as ``shift_labels`` (under CP each rank holds chunks of
    the sequence, at whose ends transformers' own shift would misalign the labels). With cp > 1
    the ids, labels and positions are the buffers ``accelerator.maybe_context_parallel`` shards
    over the sequence, and forward and backward run inside it, as the ring attention's backward
    needs; without cp it is not entered (it would only warn)."""
    import contextlib

    import torch

    # Copies: torch's context_parallel resizes its buffers in place.
    input_ids = packed[:, :-1].clone(memory_format=torch.contiguous_format)
    labels = packed[:, 1:].clone(memory_format=torch.contiguous_format)
    positions = torch.arange(input_ids.size(1)).unsqueeze(0)
    parallelism = accelerator.parallelism_config
    context: Any = contextlib.nullcontext()
    if parallelism is not None and parallelism.cp_enabled:
        buffers = [input_ids, labels, positions]
        context = accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        )
    with context:
        out = model(input_ids=input_ids, labels=labels, shift_labels=labels, position_ids=positions)
        accelerator.backward(out.loss)
    return out.loss


def _quiet_transformers() -> None:
    """transformers' notices on every rank (deprecations, loading bars): not findings."""
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
