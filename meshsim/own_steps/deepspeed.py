"""DeepSpeed 0.19.8's own training step, on N gloo ranks and alone, for the equivalence check.

What runs is DeepSpeed's engine on its CPU accelerator, in fp32: ``deepspeed.initialize(model=,
config=)`` on a tiny language model (embedding, a pre-norm MLP block, norm, LM head; vocab 64,
width 16), its data loader (``engine.deepspeed_io``: a ``DistributedSampler`` over the engine's
data-parallel rank and size, shuffled with its fixed seed), and per optimizer step
``gradient_accumulation_steps`` micro-batches of 2 rows through ``engine(...)``,
``engine.backward`` and ``engine.step`` (the update at the accumulation boundary). DeepSpeed
builds everything else from the config: ZeRO stage 1, 2 or 3 (its partitioning and gradient
reduction), gradient clipping at 0.05 (the model's norm is about 0.4: it clips every step),
torch's AdamW (``"type": "AdamW"``, ``torch_adam``) and ``WarmupLR``. The global batch is 16
rows of 9 tokens; DeepSpeed derives the accumulation steps from ``train_batch_size`` and
``train_micro_batch_size_per_gpu`` (8 alone, 4 on 2 data-parallel ranks, 2 on 4). The serial
twin is the same config on a world of one rank. One check trains ZeRO 1, 2 and 3 one after
another (``step(config, stages=...)`` picks fewer); each is recorded under ``zero<N>.``.

With ``ep`` the block is ``deepspeed.moe.layer.MoE`` (``ep`` experts, one per expert-parallel
rank, top-1, ``drop_tokens=False``, ``use_rts=False``: no token is dropped, so a token's output
does not depend on which micro-batch it shares; its auxiliary loss is not added, as it is a
product of per-micro-batch means, which no layout keeps). The engine makes the expert groups
(E + D, or D + E with ``use_data_before_expert_parallel_``), splits the expert parameters into
their own ZeRO groups and reduces them over the expert data-parallel group. Experts are drawn
from their global index (``Experts`` copies one module, so they would start equal) and
recorded under it. DeepSpeed asserts "Native DeepSpeed MoE is not supported with ZeRO Stage 3",
so an MoE check trains ZeRO 1 and 2.

With ``autotp_size`` DeepSpeed's AutoTP shards the block (``tensor_parallel.partition_config``:
the first MLP linear column-wise, the second row-wise), with DeepSpeed's own
``deepspeed.utils.groups`` as the ``mpu`` after ``groups._init_tp_mesh_device``, as its AutoTP
example passes one: without an mpu DeepSpeed 0.19.8 sizes the batch by the world, not the
data-parallel group, and trains a smaller batch than configured (``autotp_mpu=False`` runs
that; see :func:`step`). The AutoTP shards are recorded whole, gathered by their layer's own
``gather_params``.

With ``num_pp`` > 1 the model is a ``PipelineModule`` over ``PipeDataParallelTopology(num_pp,
num_dp)`` (the twin: one stage): embedding and LM head are one ``TiedLayerSpec`` (reduced over
the tied group of the first and last stage), ``seed_layers`` gives every layer the same weights
on every layout, and ``engine.train_batch`` runs DeepSpeed's 1F1B schedule. DeepSpeed asserts
"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", so a pipeline check trains ZeRO 1.

Refused, with the reason (:func:`refusal`): ``num_mp`` > 1 (the grid's model axis is an mpu
Megatron hands DeepSpeed; DeepSpeed's own TP is AutoTP), a config naming no sizes (the grid's
default split puts pipeline stages first, which the serial twin cannot tell from the world
size: give ``num_dp`` or ``num_pp``), a raw topology (``axes`` / ``dims``, ``grid=False``),
``model_parallel_size`` and ``mp_size`` / ``mp_mode`` (helpers the engine does not call here:
AutoEP's groups are the deepspeed-autoep convention), a pipeline with MoE or AutoTP, MoE with
AutoTP, and a data-parallel size the global batch does not split over.

Recorded, per optimizer step, just before DeepSpeed's ZeRO optimizer ``step`` (the engine's
``_take_model_step`` calls it once per boundary; this module wraps that bound method on the
instance): every parameter's gradient by ``deepspeed.utils.safe_get_full_grad`` and its fp32
master value by ``safe_get_full_fp32_param``. These are DeepSpeed's public accessors for the
reduced gradients in its partitioned flat buffers, valid "immediately after backward and before
engine step": the gradients reduced over the data-parallel (expert data-parallel, tied) group,
before clipping. They are recorded unclipped on purpose: clipping multiplies every gradient
by one global factor, so a single wrongly reduced gradient would show in every clipped one; the
clipping is checked by ``grad_norm`` (``engine.get_global_grad_norm()``, the norm DeepSpeed
clips with) and by the parameters of the next step and after the last. ``loss`` is what
DeepSpeed logs: the pipeline engine's ``train_batch`` value (``_aggregate_total_loss``: the
micro-batch mean, averaged over data-parallel ranks); for the plain engine the same, the sum of
``engine.backward``'s accumulation-scaled losses all-reduced over ``engine.data_parallel_group``
and divided by ``engine.dp_world_size``. The recorded tensors are copies, so ``ctx.record``
runs after the step with exactly what the optimizer was handed. meshsim's gradient trace is
stopped: it matches reductions to gradients by storage, and DeepSpeed reduces copies of them
(buckets, flat partitions), so it would claim that nothing reduced any gradient.

Shims, none of which changes what is compared:

* ``deepspeed.comm`` runs on the harness's gloo (for the twin, threaded) process group through
  :func:`meshsim.builders.real._shims.deepspeed_comm`, which skips JIT-compiling the CPU
  shared-memory op: that op only serves ``inference_all_reduce``, never a training collective
  (those are ``torch.distributed`` calls on the same group).
* ``DS_ACCELERATOR=cpu`` is set while deepspeed is first imported, and ``os.environ`` is
  restored after the import and every build (the harness replaces a worker whose environment
  changed). The data loader runs in-process (``num_local_io_workers=0``, no pinned memory).
* DeepSpeed's module globals are reset before and after, as in a fresh job, so that a warm
  worker starts clean: the group caches of ``deepspeed.utils.groups``, AutoTP's training mode,
  and ZeRO-3's id counters (``zero.Init.param_id``, and the mutable default ``count=[0]`` of
  ``DeepSpeedZeRoOffload._register_deepspeed_module`` for modules): its coordinator asserts
  that every rank traces the same ids, which ranks in workers with different histories would
  not (seen at world 4 after world-2 checks: "Detected a disagreement on list contents");
  and torch's ``nn.functional.linear``, which a ZeRO-3 build replaces process-wide with
  DeepSpeed's ``zero3_linear_wrap`` until "manually reset" (see :func:`_torch_linear`): it is
  put back after each build, so that every rank of the next check runs the same linear. The
  RNG states ``seed_layers`` reseeds are restored.

``deepspeed.comm`` keeps process globals, so N ranks run as gloo processes: a threaded world of
several ranks is refused. ``before``, when given, runs in every rank and in the twin before
anything is built (tests plant bugs there); a callable it returns runs after the step, to undo
them in the warm workers.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

GLOBAL_BATCH = 16  # rows per optimizer step: micro-batches of 2 on 1, 2, 4 or 8 dp ranks
SEQUENCE = 9  # tokens per row: 8 inputs, each predicting the next
VOCABULARY = 64
HIDDEN = 16
MICROBATCH_ROWS = 2
GRADIENT_CLIPPING = 0.05  # below the tiny model's gradient norm (about 0.4): clips every step
ZERO_STAGES = (1, 2, 3)
EXPERTS_PER_RANK = 1  # MoE: num_experts = ep x this

WHAT_RUNS = (
    "DeepSpeed's own engine step: deepspeed.initialize on a tiny language model, its data "
    "loader, engine.backward / engine.step with gradient accumulation (train_batch with "
    "num_pp), ZeRO stages 1, 2 and 3 (its partitioning, gradient reduction, gradient "
    "clipping, torch AdamW and WarmupLR from the config); MoE with ep, AutoTP with autotp_size"
)

#: Config keys this step does not run, each with why.
_UNRUN = {
    "num_mp": (
        "the grid's model axis is Megatron's tensor parallelism (an mpu DeepSpeed is handed); "
        "DeepSpeed's own engine has no tensor slicing for it. DeepSpeed's own TP is AutoTP: "
        "give --autotp-size instead"
    ),
    "model_parallel_size": "groups._create_model_parallel is a helper the engine never calls",
    "mp_size": (
        "the direct _create_expert_and_data_parallel(ep, mp_size=...) call is AutoEP's "
        "(the deepspeed-autoep convention), not the native MoE layer's this step trains"
    ),
    "mp_mode": "it goes with mp_size (AutoEP's groups), which this step does not run",
    "axes": (
        "a raw ProcessTopology: the engine takes its data-parallel layout from the world, "
        "its AutoTP groups or a PipelineModule's PipeDataParallelTopology"
    ),
    "dims": "it goes with axes (a raw ProcessTopology), which this step does not run",
}


def _topology_sizes(world_size: int, config: Mapping[str, Any]) -> tuple[int, int]:
    """(pipeline stages, data-parallel ranks) of the reference topology for ``config``."""
    from meshsim.model.conventions import deepspeed as reference

    topo = reference.topology(world_size, config)
    return max(topo.get_dim("pipe"), 1), max(topo.get_dim("data"), 1)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does)."""
    for key, why in _UNRUN.items():
        if config.get(key) not in (None, 1) or (key in ("axes", "dims") and key in config):
            return f"DeepSpeed's own step with {key}={config[key]!r}: {why}"
    if config.get("grid") is False:
        return "DeepSpeed's own step with grid=False: " + _UNRUN["axes"]
    if world_size > 1 and all(config.get(k) is None for k in ("num_pp", "num_mp", "num_dp")):
        return (
            "DeepSpeed's own step needs the layout's sizes: a config naming none is "
            "PipelineParallelGrid's default split (pipeline stages first), which its serial "
            f"twin cannot tell from the world size; give --num-dp {world_size} (data "
            "parallel) or --num-pp and --num-dp"
        )
    try:
        pp, dp = _topology_sizes(world_size, config)
    except Exception:  # the reference refuses it; check_equivalence says why
        return None
    tp = int(config.get("autotp_size") or 1)
    ep = config.get("ep")
    if pp > 1 and (ep is not None or tp > 1):
        what = "an MoE layer" if ep is not None else "AutoTP"
        return (
            f"DeepSpeed's own step with num_pp={pp} and {what}: a PipelineModule with "
            f"{what} is not run yet"
        )
    if ep is not None and tp > 1:
        return (
            "DeepSpeed's own step with ep and autotp_size: MoE with AutoTP is AutoEP's folding "
            "(the deepspeed-autoep convention), not run here"
        )
    if tp > 1:
        if world_size % tp:
            return f"autotp_size={tp} does not divide the world of {world_size} ranks"
        dp = world_size // tp
    if GLOBAL_BATCH % (MICROBATCH_ROWS * dp):
        return (
            f"DeepSpeed's own step: a global batch of {GLOBAL_BATCH} rows in micro-batches of "
            f"{MICROBATCH_ROWS} does not split over {dp} data-parallel ranks"
        )
    return None


def batch(step: int) -> Any:
    """A step's global batch: token ids; each row's tokens predict the next."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE), dtype=torch.int64)


def step(
    config: Mapping[str, Any],
    before: Callable[[], Any] | None = None,
    stages: Sequence[int] = ZERO_STAGES,
    *,
    autotp_mpu: bool = True,
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`.

    ``stages``: the ZeRO stages to train, one after another (those DeepSpeed refuses for the
    layout, ZeRO 3 with MoE and 2 and 3 with a pipeline, are left out). ``autotp_mpu=False``
    initializes AutoTP from the config alone, without an mpu (the path that sizes the batch by
    the world)."""
    return functools.partial(_step, dict(config), before, tuple(stages), autotp_mpu)


def runnable_stages(
    world_size: int, config: Mapping[str, Any], stages: Sequence[int]
) -> tuple[list[int], list[str]]:
    """The ``stages`` DeepSpeed trains with ``config``, and why each other one is left out."""
    pp, _ = _topology_sizes(world_size, config)
    kept: list[int] = []
    skipped: list[str] = []
    for stage in stages:
        if stage not in ZERO_STAGES:
            skipped.append(
                f"ZeRO stage {stage}: this step runs ZeRO 1, 2 and 3 (stage 0 has no ZeRO "
                "optimizer: the engine clips before the update it would record)"
            )
        elif config.get("ep") is not None and stage == 3:
            skipped.append(
                "ZeRO 3 with MoE: DeepSpeed asserts 'Native DeepSpeed MoE is not supported with "
                "ZeRO Stage 3' (DeepSpeedEngine._validate_zero3_moe_compatibility)"
            )
        elif pp > 1 and stage >= 2:
            skipped.append(
                f"ZeRO {stage} with num_pp={pp}: PipelineEngine asserts 'ZeRO-2 and ZeRO-3 are "
                "incompatible with pipeline parallelism'"
            )
        else:
            kept.append(stage)
    return kept, skipped


# -- the model -------------------------------------------------------------------------------
@functools.cache
def _layers() -> tuple[type, type, type]:
    """The model's pieces: token embedding, pre-norm MLP block (residual), final norm."""
    import torch

    class Embed(torch.nn.Embedding):
        pass

    class Block(torch.nn.Module):
        def __init__(self, experts: int = 0, ep: int = 1) -> None:
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(HIDDEN)
            mlp: Any = torch.nn.Sequential(
                torch.nn.Linear(HIDDEN, 2 * HIDDEN),
                torch.nn.GELU(),
                torch.nn.Linear(2 * HIDDEN, HIDDEN),
            )
            self.experts = experts
            if experts:
                from deepspeed.moe.layer import MoE

                mlp = MoE(
                    hidden_size=HIDDEN, expert=mlp, num_experts=experts, ep_size=ep, k=1,
                    drop_tokens=False, use_rts=False,
                )  # fmt: skip
            self.mlp = mlp

        def forward(self, x: Any) -> Any:
            h = self.mlp(self.norm1(x))
            if self.experts:
                h = h[0]  # (output, l_aux, exp_counts): the auxiliary loss is not trained
            return x + h

    class Norm(torch.nn.LayerNorm):
        pass

    return Embed, Block, Norm


def _loss(logits: Any, labels: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), labels.reshape(-1))


def _tied_head(embed: Any, x: Any) -> Any:
    """The LM head of the pipeline model: the embedding's weight, tied."""
    return x @ embed.weight.t()


def _plain_model(experts: int, ep: int, seed: int, before_ep: bool) -> Any:
    import torch

    embed_cls, block_cls, norm_cls = _layers()

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = embed_cls(VOCABULARY, HIDDEN)
            self.block = block_cls(experts, ep)
            self.norm = norm_cls(HIDDEN)
            self.head = torch.nn.Linear(HIDDEN, VOCABULARY)

        def forward(self, tokens: Any) -> Any:
            x = self.block(self.embed(tokens[:, :-1]))
            return _loss(self.head(self.norm(x)), tokens[:, 1:])

    torch.manual_seed(seed)
    model = TinyLM()
    if experts:
        # The groups MoE._create_process_groups makes without an mpu (this same call), made
        # first so that the expert-parallel rank names this rank's experts; the engine then
        # finds them. Each expert is drawn from its global index, so the serial twin (every
        # expert on one rank) holds the same experts.
        from deepspeed.utils import groups

        groups._create_expert_and_data_parallel(ep, use_data_before_expert_parallel_=before_ep)
        with torch.no_grad():
            for name, param in model.named_parameters():
                index = _expert_index(name, ep)
                if index is not None:
                    generator = torch.Generator().manual_seed(seed * 1000 + index)
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def _pipeline_model(pp: int, dp: int, seed: int, stages: int) -> Any:
    """The layers of ``stages`` pipeline stages (the twin builds the same on one), at least one
    per stage: a stage without parameters is an empty optimizer, which DeepSpeed refuses."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    embed_cls, block_cls, norm_cls = _layers()
    layers = [
        TiedLayerSpec("embed", embed_cls, VOCABULARY, HIDDEN),
        *(LayerSpec(block_cls) for _ in range(max(1, stages - 3))),
        LayerSpec(norm_cls, HIDDEN),
        TiedLayerSpec("embed", embed_cls, VOCABULARY, HIDDEN, forward_fn=_tied_head),
    ]
    # PipelineModule prints its partition with print() on rank 0; seed_layers reseeds.
    with _kept_rng(), contextlib.redirect_stdout(io.StringIO()):
        return PipelineModule(
            layers=layers,
            topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
            loss_fn=_loss,
            partition_method="uniform",
            seed_layers=True,
            base_seed=seed,
        )


_EXPERTS = "deepspeed_experts."


def _expert_index(name: str, ep: int) -> int | None:
    """The global index of the expert holding parameter ``name`` (None: no expert's)."""
    if _EXPERTS not in name:
        return None
    from deepspeed.utils import groups

    local = int(name.split(_EXPERTS, 1)[1].split(".", 1)[0])
    return groups._get_expert_parallel_rank(f"ep_size_{ep}") * EXPERTS_PER_RANK + local


def _global_name(name: str, ep: int) -> str:
    index = _expert_index(name, ep)
    if index is None:
        return name
    head, tail = name.split(_EXPERTS, 1)
    return f"{head}{_EXPERTS}{index}.{tail.split('.', 1)[1]}"


def _ds_config(stage: int, config: Mapping[str, Any], tp: int) -> dict[str, Any]:
    ds: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICROBATCH_ROWS,
        "gradient_clipping": GRADIENT_CLIPPING,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.get("use_data_before_expert_parallel_"):
        ds["use_data_before_expert_parallelism"] = True
    if tp > 1:
        ds["tensor_parallel"] = {
            "autotp_size": tp,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [r".*mlp\.0\.(weight|bias)$"], "partition_type": "column"},
                    {"patterns": [r".*mlp\.2\.weight$"], "partition_type": "row"},
                ],
            },
        }
    return ds


# -- process state ---------------------------------------------------------------------------
def _load() -> None:
    """Import deepspeed on its CPU accelerator, leaving ``os.environ`` as it was."""
    import sys

    from meshsim.builders.real import _shims
    from meshsim.errors import UsageError

    with _shims.unchanged_environ():
        if "deepspeed" not in sys.modules:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _shims.load("deepspeed", "deepspeed.comm.comm", "deepspeed.comm.torch")
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
    if name != "cpu":
        raise UsageError(
            f"DeepSpeed's own step runs on its CPU accelerator, and this process already picked "
            f"{name!r} (DS_ACCELERATOR or an earlier import): run it where DS_ACCELERATOR=cpu"
        )


def _quiet() -> None:
    """Silence torch's notices on the collectives DeepSpeed calls by their deprecated names."""
    import warnings

    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
    )


@contextlib.contextmanager
def _fresh_globals() -> Iterator[None]:
    """DeepSpeed's module globals a build sets, cleared before and after (a warm worker would
    hand the previous run's destroyed groups to the next, and number ZeRO-3 parameters on from
    the previous run's); ``deepspeed_clean_moe_state`` clears the MoE and AutoTP group caches."""
    from deepspeed.module_inject import layers
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.utils import groups

    mode = layers.DEEPSPEED_AUTOTP_MODE

    def clear() -> None:
        _torch_linear()
        # ZeRO-3 numbers parameters from a class counter and modules from the mutable default
        # ``count=[0]`` of ``_register_deepspeed_module`` (both ``ds_id``), and asserts that
        # every rank traces the same ids: ranks in workers that ran different checks before
        # would not. Every rank starts from 0, as in a fresh job.
        (modules,) = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
        modules[0] = 0
        Init.param_id = 0
        Init.num_persisted_parameters = 0
        Init.num_persisted_elements = 0
        Init.apply_param_persistence = False
        groups._WORLD_GROUP = None
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        groups._ALL_TO_ALL_GROUP.clear()
        groups.mesh_device = None
        groups.expert_tensor_parallel_world_size = 1

    clear()
    try:
        yield
    finally:
        clear()
        layers.DEEPSPEED_AUTOTP_MODE = mode


def _torch_linear() -> None:
    """Put back torch's ``nn.functional.linear`` where a ZeRO-3 build replaced it.

    ZeRO-3 (``memory_efficient_linear``, on by default) swaps in its own ``zero3_linear_wrap``
    process-wide and keeps torch's in ``InsertPostInitMethodToModuleSubClasses.linear_bk``
    ("This will persist unless manually reset"). Left in place, a later ZeRO-2 check whose
    ranks sit in workers with different histories (some ran a ZeRO-3 check, some did not)
    trains with two linears: ZeRO-2 then reduces wrong gradients for every linear layer
    (seen at world 4 after a world-2 ZeRO-3 check). Each ZeRO-3 engine still trains with the
    linear DeepSpeed gave it."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """Python's, numpy's and torch's RNG states put back (``seed_layers`` reseeds all three)."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


# -- recording -------------------------------------------------------------------------------
def _tp_whole(param: Any, value: Any) -> Any:
    """``value`` (shaped as ``param``) whole: an AutoTP shard gathered by its layer's own
    ``gather_params`` (collective over the tensor-parallel group); else a copy."""
    whole = value.detach().clone()
    gather = getattr(param, "gather_params", None)
    if gather is not None:
        gather([whole])
    return whole


def _gathered(engine: Any, names: Mapping[int, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's reduced gradient and fp32 value, whole, by DeepSpeed's own accessors
    (collective: every rank calls them for every parameter in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    grads, params = {}, {}
    for param in engine.module.parameters():
        name = names[id(param)]
        grad = safe_get_full_grad(param)
        if grad is not None:
            grads[name] = _tp_whole(param, grad)
        params[name] = _tp_whole(param, safe_get_full_fp32_param(param))
    return grads, params


def _capture_before_update(engine: Any, names: Mapping[int, str]) -> list[tuple[dict, dict]]:
    """A list that gets each update's (grads, params), taken as DeepSpeed's optimizer is
    handed them: the engine's ``_take_model_step`` calls ``self.optimizer.step()``, wrapped
    here on the instance."""
    taken: list[tuple[dict, dict]] = []
    optimizer = engine.optimizer
    update = optimizer.step

    def step_after_capture(*args: Any, **kwargs: Any) -> Any:
        taken.append(_gathered(engine, names))
        return update(*args, **kwargs)

    optimizer.step = step_after_capture
    return taken


def _surrogates(
    prefix: str, params: Mapping[str, Any], grads: Mapping[str, Any], experts: set[str]
) -> dict[str, Any]:
    """Recordable parameters holding the captured copies (experts marked ``allreduce=False``,
    as DeepSpeed marks them, for the comparison's expert hints)."""
    import torch

    named = {}
    for name, value in params.items():
        p = torch.nn.Parameter(value, requires_grad=False)
        if name in grads:
            p.grad = grads[name]
        if name in experts:
            p.allreduce = False  # type: ignore[attr-defined]
        named[f"{prefix}{name}"] = p
    return named


# -- the step --------------------------------------------------------------------------------
def _train(
    zero: int, config: Mapping[str, Any], ctx: Any, rows: Any, autotp_mpu: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ZeRO stage ``zero`` for ``ctx.steps`` steps: each step's records, the final
    parameters."""
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_fp32_param

    pp, dp = (1, 1) if ctx.serial else _topology_sizes(ctx.world_size, config)
    ep = 1 if ctx.serial else int(config.get("ep") or 1)
    tp = 1 if ctx.serial else int(config.get("autotp_size") or 1)
    experts = EXPERTS_PER_RANK * int(config.get("ep") or 0)
    pipeline = int(config.get("num_pp") or 1) > 1  # the twin then trains one stage
    if pipeline:
        model = _pipeline_model(pp, dp, ctx.seed, stages=int(config["num_pp"]))
        dataset = torch.utils.data.TensorDataset(rows[:, :-1], rows[:, 1:])
    else:
        before_ep = bool(config.get("use_data_before_expert_parallel_"))
        model = _plain_model(experts, ep, ctx.seed, before_ep)
        dataset = torch.utils.data.TensorDataset(rows)
    names = {id(p): _global_name(n, ep) for n, p in model.named_parameters()}
    expert_names = {names[id(p)] for p in model.parameters() if not getattr(p, "allreduce", True)}
    mpu = None
    if tp > 1 and autotp_mpu:
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
        mpu = groups
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=_ds_config(zero, config, tp), mpu=mpu
    )
    try:
        loader = engine.deepspeed_io(dataset, pin_memory=False, num_local_io_workers=0)
        taken = _capture_before_update(engine, names)
        data = iter(loader)
        prefix = f"zero{zero}."
        records = []
        for _ in range(ctx.steps):
            if pipeline:
                loss = engine.train_batch(data_iter=data).detach().clone()
            else:
                loss = torch.zeros((), dtype=torch.float32)
                for _ in range(engine.gradient_accumulation_steps()):
                    (tokens,) = next(data)
                    loss += engine.backward(engine(tokens)).detach()
                    engine.step()  # the update at the accumulation boundary only
                dist.all_reduce(loss, group=engine.data_parallel_group)
                loss /= engine.dp_world_size
            grads, params = taken.pop()
            records.append(
                {
                    "named": _surrogates(prefix, params, grads, expert_names),
                    f"{prefix}loss": loss,
                    f"{prefix}grad_norm": torch.tensor(float(engine.get_global_grad_norm())),
                }
            )
        last = {
            names[id(p)]: _tp_whole(p, safe_get_full_fp32_param(p))
            for p in engine.module.parameters()
        }
        return records, _surrogates(prefix, last, {}, expert_names)
    finally:
        engine.destroy()
        _torch_linear()


def _step(
    config: dict[str, Any],
    before: Callable[[], Any] | None,
    stages: tuple[int, ...],
    autotp_mpu: bool,
    ctx: Any,
) -> Any:
    import torch
    import torch.distributed as tdist

    from meshsim.builders.real import _shims
    from meshsim.errors import UsageError

    if not ctx.serial and str(tdist.get_backend()) == "threaded":
        raise UsageError(
            "DeepSpeed's own step keeps process globals (deepspeed.comm's backend, its group "
            "caches): run its ranks as processes, --backend gloo, not threaded"
        )
    # meshsim's gradient trace matches a reduction to a parameter by the gradient's storage;
    # DeepSpeed copies gradients into its reduction buckets and partitions, so the trace would
    # report every gradient as reduced by nothing. No trace: findings claim no reduction.
    ctx.stop_trace()
    world = 1 if ctx.serial else ctx.world_size
    reason = None if ctx.serial else refusal(world, config)
    if reason is not None:
        raise UsageError(reason)
    kept, skipped = runnable_stages(world, config, stages)
    if not kept:
        raise UsageError("DeepSpeed's own step has no ZeRO stage to train: " + "; ".join(skipped))
    _load()
    _quiet()
    undo = before() if before is not None else None
    try:
        rows = torch.cat([ctx.batch(i) for i in range(ctx.steps)])
        with (
            _shims.unchanged_environ(),
            _shims.deepspeed_comm(),
            _shims.deepspeed_clean_moe_state(),
            _fresh_globals(),
        ):
            trained = [_train(zero, config, ctx, rows, autotp_mpu) for zero in kept]
    finally:
        if callable(undo):
            undo()
    for i in range(ctx.steps):
        named: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for records, _ in trained:
            record = dict(records[i])
            named.update(record.pop("named"))
            values.update(record)
        ctx.record(named, **values)
    final: dict[str, Any] = {}
    for _, last in trained:
        final.update(last)
    return final
