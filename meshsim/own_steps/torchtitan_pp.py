"""torchtitan 0.3.0's own pipeline-parallel path, for the own step's layouts with pp > 1.

What runs is what ``torchtitan.trainer.Trainer`` runs when ``parallel_dims.pp_enabled``:

* ``__init__``: the model spec's ``pipelining_fn`` (llama3's ``pipeline_llm``) on the whole
  model. It splits the model into stages by its own ``_generate_llm_fqn_per_model_part``
  (the schedule decides one stage per rank or, for a looped schedule, two), builds each
  rank's ``PipelineStage`` over the ``pp`` mesh, applies the model's ``parallelize_fn``
  (FSDP, TP, ...) to every stage chunk and builds the schedule from
  ``parallelism.pipeline_parallel_schedule`` with ``n_microbatches = local_batch_size //
  pipeline_parallel_microbatch_size`` and ``scale_grads=False``. The loss's ``lm_head`` is
  the last stage's; the optimizer and LR schedule run over every model part.
* ``train_step``'s pp branch (``pp_forward_backward_step``): each microbatch of
  ``pipeline_parallel_microbatch_size`` rows goes through ``post_dataloading_process``, and
  ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
  loss_kwargs={"global_valid_tokens": ...})`` runs the schedule: inputs on the first stage,
  targets and losses on the last. Every microbatch's loss is divided by the valid tokens of
  the whole step summed over the batch mesh, so the microbatches' losses add up to the
  step's loss (``torch.sum(torch.stack(losses))`` on the last stage, -1 elsewhere) and their
  gradients to the step's gradient. Then ``clip_grad_norm_`` over every model part's
  parameters with ``pp_mesh`` (the norm summed over the stages) and the optimizer step.

The schedule is torchtitan's debug config's own (``Interleaved1F1B``: two stages per rank)
unless ``meshsim.own_steps.torchtitan.step(config, schedule=...)`` names another.
Schedules run on the CPU over gloo or meshsim's threaded ranks (whose point-to-point
``isend`` / ``irecv`` go through an in-process mailbox): ``torch.distributed.pipelining``'s
P2P, metadata inference and backward are device-agnostic.

Every rank records its own stages' parameters (:class:`Stages`) under the full model's names:
``_split_module`` keeps ``layers`` a ``ModuleDict`` keyed by the global layer index and drops
the modules a stage does not hold (``tok_embeddings``, ``norm``, ``lm_head`` become None), so
``layers.3.attention.wq.weight`` on the second stage is the serial model's
``layers.3.attention.wq.weight``. The comparison takes each name from the ranks that hold it.
The logged loss exists on the last stage only (the others hold torchtitan's -1) and is
recorded there; the gradient norm is recorded on every rank.

The stages are cut from the model the step built and ``init_weights``-ed in full (as for the
other layouts), so they start from the serial twin's weights; the trainer's own path (a meta
model, ``init_weights`` on each stage chunk after the split) draws per-chunk numbers.

One stand-in, computing the same numbers (:func:`presplit_step`): torchtitan 0.3.0 calls
``pp_schedule.step`` with microbatches it split itself (``arg_mbs``, ``kwarg_mbs``,
``target_mbs``), torch 2.15's signature. torch 2.13's ``step`` has no such arguments: it takes
them as whole-batch model inputs to split, so a real torchtitan 0.3.0 job with pp fails there
on torch 2.13 (``ValueError: Expecting 8 arg_mbs but got 1``; a test pins it). On such a
torch the step gets torch 2.15's pre-split path, built from torch's own pieces: exactly what
2.13's and 2.15's ``step`` do (set ``has_backward`` and clear each stage's runtime state,
then ``_step_microbatches`` of the microbatches), without splitting a whole batch (the
microbatches are already split). On torch 2.15 nothing is replaced. What the stand-in cannot
give torch 2.13 is 2.15's restore of the stages' buffers after the first step's metadata
inference, which the MoE model's token counts need: pp with ep is refused before 2.15
(:func:`refusal` says why).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The schedules the own step runs (tests/real/test_torchtitan_own_step.py runs each):
#: torchtitan's debug config's own first. It puts two stages on each pp rank.
SCHEDULES = ("Interleaved1F1B", "1F1B", "GPipe")
STAGES_PER_RANK = 2
#: The llama3 debug model's layers.
LLAMA3_LAYERS = 6


def refusal(world_size: int, config: Mapping[str, Any], moe_layers: int | None) -> str | None:
    """Why the own step does not run this pp > 1 layout (None: it does); ``moe_layers`` is the
    MoE model's layer count where the layout runs that model, else None (the caller,
    ``own_steps.torchtitan``, decides both)."""
    pp = int(config.get("pp", 1))
    if moe_layers is not None:
        reason = _metadata_inference_refusal()
        if reason is not None:
            return reason
    model, layers = (
        ("deepseek_v3 MoE", moe_layers) if moe_layers is not None else ("llama3", LLAMA3_LAYERS)
    )
    slots = layers + 2  # pipeline_llm counts the embeddings and the output as a layer
    stages = pp * STAGES_PER_RANK
    if stages > slots:
        return (
            f"torchtitan's own step with pp={pp}: its debug config's Interleaved1F1B schedule "
            f"puts {STAGES_PER_RANK} stages on each pp rank, and pipeline_llm cannot cut the "
            f"{model} debug model ({layers} layers) into {stages}: it raises 'Number of "
            f"stages ({stages}) cannot be greater than effective layers ({slots})'"
        )
    return None


def _metadata_inference_refusal() -> str | None:
    """pp with ep before torch 2.15. On its first step a schedule infers each stage's
    activation metadata by running the stage for real (``_initialize_pp_stages``: the forward,
    then a backward through it, in training mode; a stage after the first gets uninitialised
    ``torch.empty`` inputs). torch 2.15 backs up every stage buffer before and restores it
    after (``_pre_metadata_inference_backup`` / ``_post_metadata_inference_cleanup``); torch
    2.13 keeps what the probe wrote. torchtitan's MoE counts its routed tokens in a buffer
    (``tokens_per_expert_E``, read by the expert-bias update before the optimizer step), so on
    2.13 the first step's counts include the probe's forward and its activation-checkpoint
    recompute, and the first bias update differs from the serial twin's (only there: every
    gradient of that step matches). A real torchtitan 0.3.0 pp job runs on 2.15 only (its
    ``step(arg_mbs=...)``), so this belongs to the stand-in, not to torchtitan."""
    from meshsim.torch_private import torch_version

    if torch_version() >= (2, 15):
        return None
    version = ".".join(map(str, torch_version()))
    return (
        "torchtitan's own step with pp>1 and ep>1 needs torch >= 2.15: torch "
        f"{version}'s pipeline metadata inference runs each stage's forward (on uninitialised "
        "inputs after the first stage) and backward at the first step and keeps the buffers "
        "it changed, so the MoE routers' tokens_per_expert_E count that extra forward and the "
        "first expert-bias update differs from the serial twin's; torch 2.15 restores the "
        "stages' buffers after it, and torchtitan 0.3.0's pp path needs 2.15 anyway"
    )


@dataclass
class Pipeline:
    """What torchtitan's ``pipelining_fn`` returns: the schedule, this rank's model parts (its
    stages' chunks), and whether it holds the first and the last stage."""

    schedule: Any
    parts: list[Any]
    first: bool
    last: bool


def build(trainer: Any, model: Any, parallel_dims: Any, loss_fn: Any) -> Pipeline:
    """The trainer's pp branch of ``__init__``: the model spec's ``pipelining_fn`` on the
    whole (already initialised) model, as ``Trainer.__init__`` calls it."""
    import torch

    spec = trainer.model_spec
    if not spec.pipelining_fn:
        raise RuntimeError(
            f"Pipeline Parallel is enabled but {spec.name} does not support pipelining"
        )
    schedule, parts, first, last = spec.pipelining_fn(
        model,
        parallel_dims=parallel_dims,
        training=trainer.training,
        parallelism=trainer.parallelism,
        compile_config=trainer.compile,
        ac_config=trainer.activation_checkpoint,
        dump_folder=trainer.dump_folder,
        device=torch.device("cpu"),
        model_config=spec.model,
        parallelize_fn=spec.parallelize_fn,
        loss_fn=loss_fn,
    )
    presplit_step(schedule)
    return Pipeline(schedule, list(parts), first, last)


def forward_backward(
    pipeline: Pipeline,
    prepare: Callable[[Any, Any, Any], tuple[Any, Any, dict[str, Any]]],
    microbatch_size: int,
    inputs: Any,
    labels: Any,
    positions: Any,
    global_valid_tokens: Any,
    context: Callable[[], Any],
) -> Any:
    """``Trainer.pp_forward_backward_step`` on this rank's rows, cut into the microbatches of
    ``microbatch_size`` rows its loader yields with pp; ``prepare`` is the trainer's
    ``post_dataloading_process`` (masks, cp split, spmd inputs). The step's loss on the last
    stage, ``[-1.0]`` on the others, as the trainer returns it."""
    import torch

    arg_mbs: list[tuple[Any, ...]] = []
    kwarg_mbs: list[dict[str, Any]] = []
    target_mbs: list[Any] | None = [] if pipeline.last else None
    for rows in zip(
        inputs.split(microbatch_size),
        labels.split(microbatch_size),
        positions.split(microbatch_size),
        strict=True,
    ):
        mb_inputs, mb_labels, extra = prepare(*(r.contiguous() for r in rows))
        if pipeline.first:
            arg_mbs.append((mb_inputs,))
        kwarg_mbs.append(extra)
        if target_mbs is not None:
            target_mbs.append(mb_labels)
    losses: list[Any] | None = [] if pipeline.last else None
    with context():
        pipeline.schedule.step(
            arg_mbs=arg_mbs if pipeline.first else None,
            kwarg_mbs=kwarg_mbs,
            target_mbs=target_mbs,
            losses=losses,
            loss_kwargs={"global_valid_tokens": global_valid_tokens},
            return_outputs=False,
        )
    if pipeline.last:
        assert losses is not None
        return torch.sum(torch.stack(losses))
    return torch.tensor([-1.0])


class Stages:
    """This rank's model parts seen as one model under the full model's parameter names, for
    ``ctx.record`` and the gradient trace (which finds FSDP2 wrappers among ``modules()``)."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        names = [name for part in self.parts for name, _ in part.named_parameters()]
        if len(set(names)) != len(names):
            raise RuntimeError(f"two of this rank's pipeline stages share parameter names: {names}")

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        for part in self.parts:
            yield from part.named_parameters()

    def parameters(self) -> Iterator[Any]:
        for _, param in self.named_parameters():
            yield param

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        for part in self.parts:
            yield from part.named_buffers()

    def modules(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part.modules()


def presplit_step(schedule: Any) -> None:
    """Give ``schedule`` torch 2.15's ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` where its
    torch lacks it (see the module's note): the same calls 2.15 makes, from torch's own
    ``clear_runtime_states`` and ``_step_microbatches``. A whole-batch call runs unchanged."""
    step = schedule.step
    if "arg_mbs" in inspect.signature(step).parameters:
        return
    import torch

    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])

    def presplit(
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(
                *args,
                target=target,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        if args or kwargs or target is not None:
            raise ValueError("pre-split microbatches take no whole-batch inputs or target")
        if schedule._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled (use eval())")
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        arg_mbs, kwarg_mbs = schedule._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        for stage in stages:
            if stage.is_last and return_outputs:
                return schedule._merge_outputs(stage.output_chunks)
        return None

    schedule.step = presplit
