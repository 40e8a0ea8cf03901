"""Two training steps rewritten so they run under torch's ``LocalTensorMode`` and on real ranks.

``LocalTensorMode`` runs a step once for every rank: each tensor holds one value per rank, a
collective combines them. A step written for real ranks does not survive that unchanged (see
``benchmarks/local_tensor.py``): these are the rewrites, used to measure what the mode costs and
whether its numbers agree with the threaded tier's. What changed against the originals:

- every rank-dependent number comes from the ``DeviceMesh`` (``get_local_rank``: one value per
  rank under the mode) and selects with ``narrow``, never with a Python list index;
- weights and batches come from a private generator outside the mode, then are copied to every
  rank (inside the mode a private generator is drawn once per rank, in turn);
- all-gathers use ``all_gather_into_tensor`` (the list form is wrong on sub-groups);
- no clipping: the toy's default clips nothing (``max_norm=inf``), and its ``float(norm)``
  of a per-rank tensor raises unless every rank's value agrees bitwise.

:func:`dense` is ``tests/usage/toy.py``'s ``dense_step`` (bug-free, same seeds, same numbers);
:func:`dtensor_tp` is the recipe's model (DTensor TP) with gradients all-reduced by hand over
dp x cp, since FSDP2 and DDP fail under the mode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

H, F, SEQ = 4, 8, 8


def _mode() -> Any:
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode()


def everywhere(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on every rank (a LocalTensor under the mode, itself otherwise)."""
    mode = _mode()
    if mode is None:
        return tensor
    from torch.distributed._local_tensor import LocalTensor

    with mode.disable():
        return LocalTensor({r: tensor.clone() for r in mode.ranks})


def drawn(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` (a tensor or a name -> tensor mapping) drawn once, outside the mode, then
    copied to every rank."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        value = fn(*args)
    if isinstance(value, dict):
        return {k: everywhere(v) for k, v in value.items()}
    return everywhere(value)


def _mine(x: torch.Tensor, size: int, index: Any, dim: int) -> torch.Tensor:
    step = x.shape[dim] // size
    return x.narrow(dim, index * step, step).contiguous()


def _gather(x: torch.Tensor, group: Any, size: int, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, me: Any, dim: int) -> Any:
        ctx.group, ctx.size, ctx.me, ctx.dim = group, size, me, dim
        return _gather(x, group, size, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _mine(grad, ctx.size, ctx.me, ctx.dim), None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, me: Any, dim: int) -> Any:
        ctx.group, ctx.size, ctx.dim = group, size, dim
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _mine(total, size, me, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad.contiguous(), ctx.group, ctx.size, ctx.dim), None, None, None, None


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // 4, 2, 2), mesh_dim_names=("dp", "cp", "tp"))


def _toy_batch(step: int, rows: int) -> torch.Tensor:
    torch.manual_seed(1 + step)  # as StepContext.batch seeds toy.dense_batch (seed 0)
    return torch.randn(rows, SEQ, H, dtype=torch.float64)


def _toy_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "norm1.weight": 1 + 0.1 * torch.randn(H, generator=generator, dtype=torch.float64),
        "fc1.weight": 0.3 * torch.randn(F, H, generator=generator, dtype=torch.float64),
        "fc2.weight": 0.3 * torch.randn(H, F, generator=generator, dtype=torch.float64),
        "norm2.weight": 1 + 0.1 * torch.randn(H, generator=generator, dtype=torch.float64),
    }


def dense(world: int, steps: int = 2, accumulation: int = 2) -> list[dict[str, torch.Tensor]]:
    """The toy's dense model on mesh (world/4, 2, 2); per step the logged values and local
    gradients, then the local parameters."""
    mesh = _mesh(world)
    dp, cp, tp = mesh.shape
    dp_rank, cp_rank, tp_rank = (mesh.get_local_rank(a) for a in ("dp", "cp", "tp"))
    tp_group = mesh["tp"].get_group()
    grad = mesh["dp", "cp"]._flatten("dp_cp")
    grad_group, grad_size = grad.get_group(), grad.size()
    full = drawn(_toy_weights)
    params = {
        "norm1.weight": torch.nn.Parameter(full["norm1.weight"].clone()),
        "fc1.weight": torch.nn.Parameter(_mine(full["fc1.weight"], tp, tp_rank, 0)),
        "fc2.weight": torch.nn.Parameter(_mine(full["fc2.weight"], tp, tp_rank, 1)),
        "norm2.weight": torch.nn.Parameter(full["norm2.weight"].clone()),
    }
    sharded = ("fc1.weight", "fc2.weight")
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    trail = []
    for step in range(steps):
        batch = drawn(_toy_batch, step, 2 * dp)
        chunk = _mine(_mine(batch, dp, dp_rank, 0), cp, cp_rank, 1)
        tokens = _mine(chunk, tp, tp_rank, 1)
        logged = torch.zeros((), dtype=torch.float64)
        for part in tokens.chunk(accumulation, dim=0):
            x = part * params["norm1.weight"]
            x = _Gather.apply(x, tp_group, tp, tp_rank, 1)
            h = torch.relu(x @ params["fc1.weight"].T)
            y = _Scatter.apply(h @ params["fc2.weight"].T, tp_group, tp, tp_rank, 1)
            z = y * params["norm2.weight"]
            loss = (z * z).sum() / (part.shape[0] * chunk.shape[1])
            loss.backward()
            logged += loss.detach() / accumulation
        for name, p in params.items():
            p.grad /= accumulation
            if name not in sharded:  # sequence-parallel norms: summed over tp first
                dist.all_reduce(p.grad, group=tp_group)
            dist.all_reduce(p.grad, group=grad_group)
            p.grad /= grad_size
        local = sum((params[n].grad ** 2).sum() for n in sharded)
        dist.all_reduce(local, group=tp_group)
        norm = torch.sqrt(local + sum((p.grad ** 2).sum() for n, p in params.items()
                                      if n not in sharded))  # fmt: skip
        dist.all_reduce(logged, group=tp_group)
        dist.all_reduce(logged, group=grad_group)
        logged /= grad_size
        trail.append(_snapshot(params, loss=logged, grad_norm=norm))
        optimizer.step()
        optimizer.zero_grad()
    trail.append({f"final.{n}": p.detach().clone() for n, p in params.items()})
    return trail


def dtensor_tp(world: int, steps: int = 2, wrap: str = "by_hand") -> list[dict[str, Any]]:
    """The recipe's model, TP over mesh tp with DTensor, gradients reduced over dp x cp
    (``wrap``: ``"by_hand"``, or the recipe's ``"fsdp2"`` / ``"ddp"``, which the mode cannot
    run); per step the full gradients, then the full parameters."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh(world)
    dp, cp, _ = mesh.shape
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(H, 2 * H, dtype=torch.float64),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * H, H, dtype=torch.float64),
    )
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=flat)
    elif wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=flat.get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trail = []
    for step in range(steps):
        batch = drawn(_toy_batch, step, 2 * dp)
        out = model(_mine(_mine(batch, dp, dp_rank, 0), cp, cp_rank, 1))
        (out * out).mean().backward()
        for p in model.parameters() if wrap == "by_hand" else ():
            local = p.grad.to_local()
            dist.all_reduce(local, group=flat.get_group())
            local /= flat.size()
        trail.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    trail.append({f"final.{n}": p.full_tensor() for n, p in model.named_parameters()})
    return trail


def _snapshot(params: dict[str, Any], **values: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in values.items()}
    out.update({f"grad.{n}": p.grad.detach().clone() for n, p in params.items()})
    return out
