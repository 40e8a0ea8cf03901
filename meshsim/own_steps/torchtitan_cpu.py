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
* :func:`sum_reduction`: torchtitan's FSDP sets a gradient divide factor of 1.0, so FSDP2
  reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which gloo refuses; FSDP's own
  ``set_force_sum_reduction_for_comms(True)`` reduces with ``SUM`` and the same factor 1.0:
  the same numbers (multiplying by 1.0 is exact).
"""

from __future__ import annotations

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


def quiet() -> None:
    """Drop the two notices every rank prints that say nothing about the step: torchtitan's
    checkpointer on an option without a checkpoint (on the root logger, which torchtitan
    logs to), and DTensor's note that two sequential all-reduces could be one."""
    import logging

    from meshsim.dataflow import recipes

    recipes._quiet()
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
