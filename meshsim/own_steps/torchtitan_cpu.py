"""What torchtitan 0.3.0's own training step needs to run on a CPU with gloo, each explained.

None of these touches what the equivalence check measures: which ranks hold which shard,
which groups reduce what, the loss and its normalisation, the gradient norm and the optimizer
update. Each replaces an accelerator-only piece with the CPU computation of the same numbers.

* :func:`stub_triton_kernels`: ``torchtitan.distributed.minimal_async_ep.kernels`` does
  ``import triton`` at import time and is reached from every decoder model (``decoder ->
  moe -> token_dispatcher``); a CPU torch has no triton. The module is replaced by one whose
  every kernel raises if called (the async EP kernels; the dense models never call them).
* :func:`cpu_device`: ``torchtitan.tools.utils.device_type`` is ``"cuda"`` on a GPU-less
  machine (``_get_available_device_type() or "cuda"``); set to ``"cpu"`` where torchtitan
  reads it (utils, parallel_dims).
* :func:`eager_attention`: the models' ``FlexAttention`` calls ``torch.compile
  (flex_attention)``, which refuses backward on CPU; the stand-in computes the same masked
  softmax attention from the ``BlockMask``'s own ``mask_mod``, eagerly, in float32.
* :func:`eager_cp_block_mask`: with cp > 1, torch's context parallelism builds each rank's
  ``BlockMask`` (its query shard against the whole key sequence) with
  ``torch.compile(create_block_mask)``; the stand-in hands it the eager ``create_block_mask``,
  which makes the same BlockMask without a compile per rank (as for the decoder's masks).
* :func:`sum_reduction`: torchtitan's FSDP sets a gradient divide factor of 1.0, so FSDP2
  reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which gloo refuses; FSDP's own
  ``set_force_sum_reduction_for_comms(True)`` reduces with ``SUM`` and the same factor 1.0:
  the same numbers (multiplying by 1.0 is exact).

The MoE step (deepseek_v3's debug model, for layouts with ``ep > 1``) needs one more stand-in
and runs the rest as it is. torchtitan 0.3.0's EP token dispatch (``AllToAllTokenDispatcher``:
the argsort by expert, the count exchange and the two ``all_to_all_single`` calls, the
``_permute`` indices from ``repeat_interleave`` and ``deterministic_scatter_add``) is plain
torch, with no triton kernel on this path; it runs on CPU over the threaded backend and gloo
(whose ``all_to_all_single`` takes uneven splits). ``torch._grouped_mm`` has a CPU kernel in
torch 2.13 (checked against a per-expert loop: equal to the last bit, forward and backward).
Where DTensor redistributes Shard to Shard (with tp), torch itself falls back on CPU from
all-to-all to all-gather and a chunk (it logs "CPU process group does not support alltoall
yet"): the same data moved another way.

* :func:`float32_experts`: torchtitan's ``GroupedExperts.forward`` casts the routed experts'
  inputs and weights to bfloat16 whatever the configured precision (``mixed_precision_param``
  does not reach it); the step computes in float32 (``mixed_precision_param="float32"``), and
  the stand-in drops those casts only, so the experts run torchtitan's own forward, and
  ``torch._grouped_mm``, in float32.
  This is a precision choice, like ``mixed_precision_param``, not the same numbers as a
  bfloat16 GPU run: in bfloat16 each expert-data-parallel rank rounds its partial gradient
  before FSDP sums it, and the serial twin rounds the total, so the two differ by bfloat16's
  rounding (2.4e-3 relative at world 4, dp_shard=4, ep=2), above any float32 tolerance and
  unrelated to which ranks reduce what. Which tokens go to which expert on which rank, and
  every reduction, are unchanged.
* the router's ``torch.autocast(device_type=x.device.type, dtype=torch.float32)`` is a CUDA
  autocast; CPU autocast takes bfloat16 / float16 only and warns and stays off for float32.
  With float32 parameters the gate computes in float32 either way (what the autocast is for),
  so nothing is replaced; :func:`quiet` drops the warning.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import types
from types import SimpleNamespace
from typing import Any

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def stub_triton_kernels() -> None:
    if importlib.util.find_spec("triton") is not None or KERNELS in sys.modules:
        return

    def unavailable(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{KERNELS}.{name} needs triton, which a CPU torch lacks")

        return kernel

    stub = types.ModuleType(KERNELS)
    stub.__getattr__ = unavailable  # type: ignore[method-assign]
    sys.modules[KERNELS] = stub


def cpu_device() -> None:
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"


def eager_attention() -> None:
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(_eager_flex_attention)
    # ``decoder.create_attention_mask`` is ``torch.compile(create_block_mask)``: the eager
    # function makes the same BlockMask without a compile per rank.
    decoder.create_attention_mask = create_block_mask


def eager_cp_block_mask() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask


def float32_experts() -> None:
    """Run ``GroupedExperts.forward`` (torchtitan's own) with its bfloat16 casts left out."""
    from torchtitan.models.common.moe import GroupedExperts

    forward = GroupedExperts.forward
    if getattr(forward, "_meshsim_float32", False):
        return

    def forward_in_float32(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _keep_float32()():
            return forward(self, *args, **kwargs)

    forward_in_float32._meshsim_float32 = True  # type: ignore[attr-defined]
    forward_in_float32._meshsim_original = forward  # type: ignore[attr-defined]
    GroupedExperts.forward = forward_in_float32  # type: ignore[method-assign]


@functools.cache
def _keep_float32() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    class KeepFloat32(TorchFunctionMode):
        """``float32_tensor.bfloat16()`` returns the tensor itself; every other call runs."""

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is torch.Tensor.bfloat16 and args[0].dtype == torch.float32:
                return args[0]
            return func(*args, **(kwargs or {}))

    return KeepFloat32


def quiet() -> None:
    """Drop the notices every rank prints that say nothing about the step: torchtitan's
    checkpointer on an option without a checkpoint (on the root logger, which torchtitan
    logs to), DTensor's note that two sequential all-reduces could be one, and CPU
    autocast's refusal of the router's float32 autocast (see the module's note)."""
    import logging
    import warnings

    from meshsim.dataflow import recipes

    recipes._quiet()
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not")
    root = logging.getLogger()
    if not any(isinstance(f, _NoCheckpointNotice) for f in root.filters):
        root.addFilter(_NoCheckpointNotice())


class _NoCheckpointNotice:
    def filter(self, record: Any) -> bool:
        return "has no effect without an initial_load_path" not in str(record.msg)


def sum_reduction(model: Any) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _eager_flex_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: Any = None,
    kernel_options: Any = None,
) -> tuple[Any, Any]:
    import torch
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise NotImplementedError("the eager attention stand-in takes a block mask only")
    heads, width = q.shape[1], q.shape[-1]
    if k.shape[1] != heads:  # grouped-query attention
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = 1.0 / math.sqrt(width) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if block_mask is not None:
        batch, mask_heads = block_mask.shape[0], block_mask.shape[1]
        mask = create_mask(
            block_mask.mask_mod, batch, mask_heads, q.shape[2], k.shape[2], device=q.device
        )
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, SimpleNamespace(lse=lse if want_lse else None, max_scores=None)
