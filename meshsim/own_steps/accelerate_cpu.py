"""What accelerate 1.15's context parallelism needs to run on a CPU with gloo, explained.

accelerate's ``maybe_context_parallel`` is torch's ``context_parallel`` (torch 2.13,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``): it shards the
buffers along the sequence (head-tail load-balanced), and patches
``torch.nn.functional.scaled_dot_product_attention`` so that the query, key and value become
DTensors sharded on the sequence dim (``sdpa_input_fn``). On a GPU, SDPA then dispatches to
``aten._scaled_dot_product_flash_attention`` (or the efficient / cuDNN op), which CP's DTensor
handler (``_sdpa_handler``) runs as ring attention: each rank's queries against every rank's
keys and values, the partial results merged by their log-sum-exp, and the backward the same
way, with the key / value gradients sent back around the ring.

On a CPU, SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` instead,
which CP has no handler for, and DTensor has no sharding strategy for: every rank raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
not have a sharding strategy registered.`` (measured: torch 2.13.0+cpu, gloo, world 2). With
the math backend forced (``sdpa_kernel(SDPBackend.MATH)``) it raises ``aten.add.Tensor got
mixed torch.Tensor and DTensor`` (the causal mask is a plain tensor). Both are loud; neither
attends each rank to its own chunk only.

:func:`ring_attention_on_cpu` routes CPU SDPA to the op torch's CP does handle, so that
torch's own ring runs:

* inside the step, ``scaled_dot_product_attention`` given DTensor query / key / value on the
  CPU (only CP makes those) calls ``aten._scaled_dot_product_flash_attention``; every other
  call (the serial twin, any mask, dropout or GQA) goes to torch's SDPA unchanged;
* that op and its backward get CPU kernels, which call the CPU flash-attention kernels
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) on each block the ring
  hands them. They return the output and the log-sum-exp, in the layout CP's merge reads.

So the sharding rules, the load balancing, the ring (forward, backward and the merge by
log-sum-exp) are torch's CP, unchanged; only the kernel for each block is the CPU one, as the
serial twin's is. Measured against full causal SDPA (torch 2.13.0+cpu, gloo, float32): the
unsharded output and the query, key and value gradients agree to 1.2e-06 at cp 2 (16 and 18
tokens: with and without load balancing) and cp 4 (32 tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _flash_forward(
    query: Any,
    key: Any,
    value: Any,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention`` on the CPU: the CPU flash kernel's output
    and log-sum-exp ([batch, heads, queries], float32, as the CUDA kernel's), and the outputs
    CP's handler passes through (no cumulative sequence lengths, as for dense inputs; an
    unused seed and offset: there is no dropout)."""
    import torch

    aten = torch.ops.aten
    output, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    seed = torch.zeros(2, dtype=torch.uint64)
    offset = torch.zeros((), dtype=torch.uint64)
    debug = query.new_empty(0)
    return (output, logsumexp, None, None, query.size(2), key.size(2), seed, offset, debug)


def _flash_backward(
    grad_out: Any,
    query: Any,
    key: Any,
    value: Any,
    out: Any,
    logsumexp: Any,
    cum_seq_q: Any,
    cum_seq_k: Any,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Any,
    philox_offset: Any,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention_backward`` on the CPU: the CPU flash
    kernel's backward, from the same output and log-sum-exp."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
    )


def _routed(original: Any) -> Any:
    """``scaled_dot_product_attention`` sending CP's CPU DTensors to the flash op CP handles."""
    import torch

    def scaled_dot_product_attention(  # the name CP's patch sets on torch.nn.functional
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        from torch.distributed.tensor import DTensor

        if (
            isinstance(query, DTensor)
            and query.device.type == "cpu"
            and attn_mask is None
            and dropout_p == 0.0
            and not enable_gqa
        ):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    return scaled_dot_product_attention


@contextlib.contextmanager
def ring_attention_on_cpu() -> Iterator[None]:
    """CPU SDPA routed to torch's CP ring attention while inside (see the module doc); the
    kernels and ``torch.nn.functional.scaled_dot_product_attention`` are put back after."""
    import torch
    import torch.nn.functional as F

    library = torch.library.Library("aten", "IMPL")
    original = F.scaled_dot_product_attention
    try:
        library.impl("_scaled_dot_product_flash_attention", _flash_forward, "CPU")
        library.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
        F.scaled_dot_product_attention = _routed(original)
        yield
    finally:
        F.scaled_dot_product_attention = original
        library._destroy()
