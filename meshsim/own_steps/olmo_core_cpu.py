"""What OLMo-core 3.0.0's own step needs to run on the CPU, each piece explained.

Used by :mod:`meshsim.own_steps.olmo_core`, only inside its step: the MoE kernels for layouts
with an expert-parallel config (its MoE model), the all-to-all fix for context parallelism
on gloo.

OLMo's capacity-based MoE (``MoEType.default``: ``ParallelMLP`` over ``MoEMLP``, what
``TransformerConfig.smallmoe`` builds) routes tokens through ``olmo_core.ops.moe``'s
``BinnedGatherOp`` / ``BinnedScatterOp`` autograd functions, whose forward and backward call
``olmo_core.kernels.moe`` (megablocks' triton kernels: ``binned_gather``, ``binned_scatter``,
``binned_scatter_wgrad``). ``olmo_core.ops.moe`` imports that module under ``try``; on a CPU
torch there is no triton, so ``kernels`` is None and the ops assert. Everything else on the
path is plain torch: the router (``torch.topk``, its load-balancing and z losses), the sort by
expert, ``torch.bmm`` in ``MoEMLP``, and the expert-parallel ``all_to_all_single`` (through
OLMo's own ``AllToAllOp``), which runs over gloo and torch's threaded backend.

* :func:`cpu_kernels` binds ``olmo_core.ops.moe.kernels`` (only while it is None: a machine
  with triton keeps OLMo's) to :class:`BinnedKernels`, the same three functions written with
  torch indexing. Each computes the kernel's numbers exactly: a kernel program copies one row
  (``x[index // top_k]``, times ``weights[index]`` when given, computed in float32 as here) to
  one slot ``(expert, entry)`` of a ``(num_experts, capacity, hidden)`` buffer that starts at
  zero, for the first ``min(capacity, tokens routed to the expert)`` entries of each expert's
  bin (the rest are dropped, as the kernel's early return drops them); the scatter runs the
  same copy the other way and sums over ``top_k``; the weight gradient is the per-slot dot
  product. No two programs write the same place, so the order they run in changes nothing.
  OLMo's autograd functions (which kernel runs in backward, with which weights) are unchanged.
* :func:`gloo_all_to_all`: OLMo's Ulysses attention exchanges K and V with
  ``olmo_core.distributed.nn.all_to_all``, which is torch's
  ``torch.distributed.nn.functional.all_to_all``. On gloo, torch's ``_AlltoAll.forward``
  implements it as one ``dist.scatter`` per group member and passes the member's group rank
  ``i`` as ``src``, which ``dist.scatter`` reads as a global rank: in any cp group other than
  ranks 0, 1, ... (world 4 with cp=2: the group of ranks 2 and 3; a cp of 1 on rank 1) it
  raises "Global rank 0 is not part of group" (torch's nn.functional collectives mix group
  and global ranks, as pytorch/pytorch#130515 reports for their broadcast). The stand-in
  runs the same scatters with ``group_src=i``: the same data, from the member torch meant.
  Other backends keep torch's own forward (``dist.all_to_all``).
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()


def cpu_kernels() -> None:
    with _LOCK:
        from olmo_core.ops import moe

        if moe.kernels is None:
            moe.kernels = BinnedKernels()


def _slots(indices: Any, bins: Any, capacity: int) -> tuple[Any, Any, Any]:
    """For each kept entry of the expert-sorted ``indices``: its index into ``tokens *
    top_k``, and the (expert, entry) slot it takes; an entry past its expert's capacity is
    dropped."""
    import torch

    bins = bins.long()
    position = torch.arange(indices.numel(), dtype=torch.long, device=indices.device)
    expert = torch.searchsorted(bins, position, right=True)
    starts = torch.cat([bins.new_zeros(1), bins[:-1]])
    entry = position - starts[expert.clamp(max=bins.numel() - 1)]
    kept = (expert < bins.numel()) & (entry < capacity)
    return indices.long()[kept], expert[kept], entry[kept]


class BinnedKernels:
    """CPU equivalents of ``olmo_core.kernels.moe``'s binned kernels (see the module's note)."""

    @staticmethod
    def binned_gather(
        x: Any, indices: Any, weights: Any, bins: Any, expert_capacity: int, top_k: int
    ) -> Any:
        import torch

        out = torch.zeros(
            (bins.shape[0], expert_capacity, x.shape[1]), dtype=x.dtype, device=x.device
        )
        index, expert, entry = _slots(indices, bins, expert_capacity)
        rows = x[index // top_k].float()
        if weights is not None:
            rows = rows * weights[index].float().unsqueeze(1)
        out[expert, entry] = rows.to(x.dtype)
        return out

    @staticmethod
    def binned_scatter(x: Any, indices: Any, weights: Any, bins: Any, top_k: int) -> Any:
        import torch

        capacity, hidden = x.shape[1:]
        tokens = indices.shape[0] // top_k
        out = torch.zeros((tokens * top_k, hidden), dtype=x.dtype, device=x.device)
        index, expert, entry = _slots(indices, bins, capacity)
        rows = x[expert, entry].float()
        if weights is not None:
            rows = rows * weights[index].float().unsqueeze(1)
        out[index] = rows.to(x.dtype)
        out = out.view(tokens, top_k, hidden)
        return out.sum(dim=1) if top_k > 1 else out.view(tokens, hidden)

    @staticmethod
    def binned_scatter_wgrad(x: Any, grad: Any, indices: Any, bins: Any, top_k: int) -> Any:
        import torch

        capacity = x.shape[1]
        tokens = indices.shape[0] // top_k
        out = torch.zeros((tokens * top_k,), dtype=x.dtype, device=x.device)
        index, expert, entry = _slots(indices, bins, capacity)
        dots = (x[expert, entry].float() * grad[index // top_k].float()).sum(dim=1)
        out[index] = dots.to(x.dtype)
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"olmo_core.kernels.moe.{name} needs triton, which a CPU torch lacks; meshsim's "
                "CPU stand-in has the capacity-based MoE's binned kernels only"
            )

        return unavailable


def gloo_all_to_all() -> None:
    with _LOCK:
        from torch.distributed.nn import functional

        forward = functional._AlltoAll.forward
        if getattr(forward, "_meshsim_group_src", False):
            return

        def forward_by_group_rank(ctx: Any, group: Any, out_tensor_list: Any, *tensors: Any) -> Any:
            import torch.distributed as dist

            if dist.get_backend(group=group) != dist.Backend.GLOO:
                return forward(ctx, group, out_tensor_list, *tensors)
            size = dist.get_world_size(group=group)
            ctx.group = group
            ctx.input_tensor_size_list = [tensors[i].size() for i in range(size)]
            me = dist.get_rank(group=group)
            tensors = tuple(t.contiguous() for t in tensors)
            for i in range(size):
                sent = list(tensors) if i == me else None
                dist.scatter(out_tensor_list[i], sent, group=group, group_src=i)
            return tuple(out_tensor_list)

        forward_by_group_rank._meshsim_group_src = True  # type: ignore[attr-defined]
        functional._AlltoAll.forward = staticmethod(forward_by_group_rank)  # type: ignore[method-assign]
