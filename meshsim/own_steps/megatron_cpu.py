"""What megatron-core 0.16.1's own step needs to run on the CPU, each piece explained.

Used by :mod:`meshsim.own_steps.megatron`, only inside its step.

CUDA on this path, with a CPU-only torch (each site seen in a run):

* ``torch.cuda.current_device()`` as a ``device=``: DDP's grad and param buffers
  (``param_and_grad_buffer.py`` ``_ParamAndGradBuffer``), sequence-parallel gathers and
  reduce-scatters (``tensor_parallel/mappings.py``, ``layers.py``
  ``LinearWithGradAccumulationAndAsyncCommunication``, the ``GlobalMemoryBuffer`` in
  ``utils.py``), pipeline receive buffers (``p2p_communication.py``);
* ``device="cuda"`` literals: ``total_num_tokens`` in both schedules, ``get_default_causal_mask``
  (``transformer/utils.py``), ``FP32Optimizer._scale``, ``MixedPrecisionOptimizer``'s
  ``_dummy_overflow_buf`` / ``_scale_one`` (distributed optimizer),
  ``clip_grads.get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` (``dummy_overflow_buf``)
  and ``utils.local_multi_tensor_l2_norm`` (its result); ``Tensor.cuda()`` in
  ``LanguageModule.setup_embeddings_and_output_layer`` (pp: the tied output weight);
* ``param.type() == 'torch.cuda.FloatTensor'``: ``DistributedOptimizer`` (TypeError on a CPU
  parameter) and ``clip_grad_by_total_norm_fp32`` (asserts);
* ``torch.cuda.Stream(device=torch.cuda.current_device())`` in DDP with several
  distributed-optimizer instances (used only under ``overlap_grad_reduce``, off here);
* ``torch.cuda.synchronize()`` after ``batch_isend_irecv`` (``p2p_communication.py``, pp);
* the CUDA RNG tracker: ``model_parallel_cuda_manual_seed`` and the tracker's ``fork()``
  around attention dropout call ``torch.cuda.get_rng_state``.

What stands in, and why it changes no number the check compares:

* :func:`cuda_as_cpu`, only inside the step and only on the rank's thread: a
  ``TorchFunctionMode`` that makes a tensor asked for on ``cuda`` on the CPU, returns the CPU
  tensor for ``Tensor.cuda()`` and reports a CPU tensor's ``type()`` under its CUDA name (the
  same dtype: ``torch.cuda.FloatTensor`` for ``torch.FloatTensor``); there, too,
  ``torch.cuda.current_device`` answers the CPU device and ``torch.cuda.Stream`` makes a
  stand-in that raises if used. The same operations run on the same dtypes, on the CPU.
* ``batch_p2p_sync=False`` (a megatron config field): the schedule ``wait()``s on every
  request before that synchronize, which only orders CUDA streams.
* the RNG tracker: megatron's own ``model_parallel_cuda_manual_seed(...,
  inference_rng_tracker=True)``, whose ``fork()`` is a no-op. It guards only dropout (0 here:
  nothing random runs in the step) and GPU initialisation (not used).
* sequence parallelism: the local spec's norm without apex is ``WrappedTorchNorm``, which
  asserts "sequence parallel not supported by torch LayerNorm" (apex's ``FusedLayerNorm`` is
  CUDA-only). The step builds the spec's layers with torch's ``LayerNorm`` marked
  ``sequence_parallel`` on its weight and bias, as ``FusedLayerNorm`` marks them (the mark is
  what ``finalize_model_grads`` all-reduces over tp); the twin keeps ``WrappedTorchNorm``,
  which is torch's ``LayerNorm`` too.
* MoE: megatron-core 0.16.1's ``moe_utils`` leaves ``te_general_gemm`` undefined without
  TransformerEngine, so the router raises NameError on any device; it is bound to None for
  the step, as Megatron-LM's main does, which takes the router's own ``torch.mm`` path. And
  no biases: the expert MLP adds its bias in place (``output += output_bias * ...``,
  ``transformer/mlp.py``) to what ``reduce_from_tensor_model_parallel_region`` returns, which
  with expert tp and ep of 1 (the twin) is its input passed through a custom autograd
  Function: autograd raises "Output 0 of _ReduceFromModelParallelRegion is a view and is being
  modified inplace".
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

_ON = threading.local()


def _cuda(device: Any) -> bool:
    import torch

    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaAsCpu(TorchFunctionMode):
        """Tensors megatron asks for on ``cuda`` are made on the CPU (see the module doc)."""

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if _cuda(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                if name.startswith("torch.") and not name.startswith("torch.cuda."):
                    return "torch.cuda." + name.removeprefix("torch.")
                return name
            return func(*args, **kwargs)

    return CudaAsCpu()


class _UnusedStream:
    """What ``torch.cuda.Stream(...)`` makes inside the step. megatron's DDP makes one
    communication stream when there are several distributed-optimizer instances and uses it
    only under ``overlap_grad_reduce``, which this step leaves off: any use raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"megatron used torch.cuda.Stream's stand-in (.{name}): meshsim's CPU step "
            "expected it unused without overlap_grad_reduce"
        )


def _on_this_thread(original: Callable[..., Any], inside: Callable[..., Any]) -> Any:
    """``original``, or ``inside`` on a thread that is inside :func:`cuda_as_cpu`."""

    @functools.wraps(original, updated=())  # a class too (Stream): not its __dict__
    def patched(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ON, "depth", 0):
            return inside(*args, **kwargs)
        return original(*args, **kwargs)

    return patched


_PATCH_LOCK = threading.Lock()
_USERS = [0]
_PATCHED: list[tuple[Any, str, Any]] = []


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Inside, on this thread: megatron's CUDA tensors are CPU tensors (see the module doc).

    ``torch.cuda.current_device`` and ``torch.cuda.Stream`` are replaced while any thread is
    inside, and answer as before on every other thread."""
    import torch

    with _PATCH_LOCK:
        if _USERS[0] == 0:
            for name, inside in (
                ("current_device", lambda: torch.device("cpu")),
                ("Stream", lambda *args, **kwargs: _UnusedStream()),
            ):
                original = getattr(torch.cuda, name)
                _PATCHED.append((torch.cuda, name, original))
                setattr(torch.cuda, name, _on_this_thread(original, inside))
        _USERS[0] += 1
    _ON.depth = getattr(_ON, "depth", 0) + 1
    try:
        with _mode():
            yield
    finally:
        _ON.depth -= 1
        with _PATCH_LOCK:
            _USERS[0] -= 1
            if _USERS[0] == 0:
                while _PATCHED:
                    module, name, original = _PATCHED.pop()
                    setattr(module, name, original)


@contextlib.contextmanager
def router_gemm_fallback() -> Iterator[None]:
    """megatron-core 0.16.1's ``moe_utils`` binds ``te_general_gemm`` only when its
    TransformerEngine import succeeds, and ``RouterGatingLinearFunction.forward`` /
    ``backward`` then test ``te_general_gemm is not None``: a NameError without TE, on any
    device. Megatron-LM's main binds it to None there (its ``else:`` branch); so does this,
    for the step, which makes the router take megatron's own ``torch.mm`` / ``torch.addmm``
    path."""
    from megatron.core.transformer.moe import moe_utils

    missing = not hasattr(moe_utils, "te_general_gemm")
    if missing:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        if missing:
            del moe_utils.te_general_gemm


def marked_layer_norm() -> type:
    import torch

    class MarkedLayerNorm(torch.nn.LayerNorm):
        """torch's LayerNorm with the ``sequence_parallel`` marks megatron's apex-backed
        ``FusedLayerNorm`` puts on its weight and bias (see the module doc)."""

        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
            super().__init__(hidden_size, eps=eps)
            for param in (self.weight, self.bias):
                param.sequence_parallel = config.sequence_parallel

    return MarkedLayerNorm


def with_marked_norms(spec: Any, model_config: Any) -> Any:
    """The local layer spec with :func:`marked_layer_norm` for its norms, as the block spec
    of this pipeline stage's layers (the block's final norm too)."""
    import dataclasses

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    norm = marked_layer_norm()
    submodules = spec.submodules
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        current = getattr(submodules, field)
        if current is not None and getattr(current, "__name__", "") == "WrappedTorchNorm":
            submodules = dataclasses.replace(submodules, **{field: norm})
    layer = dataclasses.replace(spec, submodules=submodules)
    layers = get_num_layers_to_build(model_config)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)
