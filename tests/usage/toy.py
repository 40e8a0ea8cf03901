"""Two tiny models trained the Megatron way, by hand, with one switch per usage bug.

Dense (:func:`dense_step`, a torch mesh ``(dp, cp, tp)``): a sequence-parallel norm weight,
a column- then row-parallel MLP and a second norm, on tokens split over dp (batch), cp and
tp (sequence: context parallelism, then sequence parallelism inside each cp chunk). MoE
(:func:`moe_step`, megatron with ``expert_model_parallel_size``): a router and experts
spread over the expert-parallel group, tokens dispatched by all-gather and combined by
reduce-scatter (Megatron's all-gather dispatcher).

Every bug here trains to the end with no error and no hang: only the comparison with the
serial step shows it. ``bug=None`` is the correct twin.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

H, F, SEQ, BATCH, EXPERTS = 4, 8, 8, 4, 4

DENSE_BUGS = (
    "norm_grad_not_reduced_over_tp",
    "loss_averaged_over_dp_not_dp_cp",
    "clip_norm_over_local_shard",
    "logged_loss_not_reduced_over_cp",
    "accumulation_divided_by_wrong_count",
    "tp_peers_seeded_differently",
)
MOE_BUGS = ("experts_reduced_over_dense_dp", "router_grad_misses_other_ep_ranks")


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward sums the gradients and keeps mine."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _mine(grad, ctx.group, ctx.dim), None, None


class _Scatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` over ``group`` (sum, keep mine); backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _mine(total, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


def _mine(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size, me = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=dim)[me].contiguous()


def _param(full: torch.Tensor, **marks: Any) -> torch.nn.Parameter:
    param = torch.nn.Parameter(full.clone())
    for key, value in marks.items():
        setattr(param, key, value)
    return param


def _shard(full: torch.Tensor, dim: int, index: int, count: int, **marks: Any) -> Any:
    return _param(full.chunk(count, dim=dim)[index], tensor_model_parallel=True,
                  partition_dim=dim, **marks)  # fmt: skip


def dense_batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, H, dtype=torch.float64)


def dense_step(
    ctx: Any, bug: str | None = None, accumulation: int = 2, max_norm: float = float("inf")
) -> dict[str, Any]:
    """The dense model, trained ``ctx.steps`` steps of ``accumulation`` micro-batches, gradients
    clipped to ``max_norm``; returns its parameters by name."""
    tp, tp_rank = ctx.size("tensor"), ctx.local_rank("tensor")
    cp, cp_rank = ctx.size("context"), ctx.local_rank("context")
    dp, dp_rank = ctx.size("data_parallel"), ctx.local_rank("data_parallel")
    tp_group, dp_group = ctx.group("tensor"), ctx.group("data_parallel")
    grad_group = ctx.group("gradient_reduce")
    grad_size = ctx.size("gradient_reduce")

    seed = ctx.seed + (tp_rank if bug == "tp_peers_seeded_differently" else 0)
    generator = torch.Generator().manual_seed(seed)
    full = {
        "norm1.weight": 1 + 0.1 * torch.randn(H, generator=generator, dtype=torch.float64),
        "fc1.weight": 0.3 * torch.randn(F, H, generator=generator, dtype=torch.float64),
        "fc2.weight": 0.3 * torch.randn(H, F, generator=generator, dtype=torch.float64),
        "norm2.weight": 1 + 0.1 * torch.randn(H, generator=generator, dtype=torch.float64),
    }
    params = {
        "norm1.weight": _param(full["norm1.weight"], sequence_parallel=True),
        "fc1.weight": _shard(full["fc1.weight"], 0, tp_rank, tp),
        "fc2.weight": _shard(full["fc2.weight"], 1, tp_rank, tp),
        "norm2.weight": _param(full["norm2.weight"], sequence_parallel=True),
    }
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    for step in range(ctx.steps):
        batch = ctx.batch(step)
        local_batch = batch.chunk(dp, dim=0)[dp_rank]
        chunk = local_batch.chunk(cp, dim=1)[cp_rank]  # this cp rank's part of each sequence
        tokens = chunk.chunk(tp, dim=1)[tp_rank]  # sequence parallel inside the chunk
        logged = torch.zeros((), dtype=torch.float64)
        for part in tokens.chunk(accumulation, dim=0):
            chunk_tokens = part.shape[0] * chunk.shape[1]
            x = part * params["norm1.weight"]
            x = _Gather.apply(x, tp_group, 1)
            h = torch.relu(x @ params["fc1.weight"].T)
            y = _Scatter.apply(h @ params["fc2.weight"].T, tp_group, 1)
            z = y * params["norm2.weight"]
            # This rank's share of its cp chunk's mean loss: tp peers' shares sum to it.
            loss = (z * z).sum() / chunk_tokens
            loss.backward()
            logged += loss.detach() / accumulation
        # The mean over this rank's micro-batches; the bug counts every dp rank's micro-batches.
        count = accumulation * (dp if bug == "accumulation_divided_by_wrong_count" else 1)
        for p in params.values():
            p.grad /= count
        for p in params.values():
            if getattr(p, "sequence_parallel", False) and bug != "norm_grad_not_reduced_over_tp":
                dist.all_reduce(p.grad, group=tp_group)
        for p in params.values():
            dist.all_reduce(p.grad, group=grad_group)
            p.grad /= dp if bug == "loss_averaged_over_dp_not_dp_cp" else grad_size
        norm = _grad_norm(params, tp_group, local_only=bug == "clip_norm_over_local_shard")
        clip = min(1.0, max_norm / float(norm))
        for p in params.values():
            p.grad *= clip
        dist.all_reduce(logged, group=tp_group)
        if bug == "logged_loss_not_reduced_over_cp":
            dist.all_reduce(logged, group=dp_group)
            logged /= dp
        else:
            dist.all_reduce(logged, group=grad_group)
            logged /= grad_size
        ctx.record(params, loss=logged, grad_norm=norm)
        optimizer.step()
        optimizer.zero_grad()
    return params


def _grad_norm(params: dict[str, Any], tp_group: Any, *, local_only: bool) -> torch.Tensor:
    """The global gradient norm: tp-sharded gradients summed over tp, replicated ones once."""
    sharded = sum((p.grad**2).sum() for p in params.values() if _tp_sharded(p))
    replicated = sum((p.grad**2).sum() for p in params.values() if not _tp_sharded(p))
    sharded = torch.as_tensor(sharded, dtype=torch.float64)
    if not local_only:
        dist.all_reduce(sharded, group=tp_group)
    return torch.sqrt(sharded + replicated)


def _tp_sharded(p: Any) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def moe_batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, H, dtype=torch.float64)


def moe_step(ctx: Any, bug: str | None = None) -> dict[str, Any]:
    """The MoE layer, trained ``ctx.steps`` steps; returns its parameters by name (experts by
    their global index, so the serial model's ``experts.3.weight`` is the same expert)."""
    ep, ep_rank = ctx.size("expert"), ctx.local_rank("expert")
    dp, dp_rank = ctx.size("data_parallel"), ctx.local_rank("data_parallel")
    ep_group, dp_group = ctx.group("expert"), ctx.group("data_parallel")
    expert_dp_group = ctx.group("expert_data")
    local = EXPERTS // ep
    mine = range(ep_rank * local, (ep_rank + 1) * local)

    generator = torch.Generator().manual_seed(ctx.seed)
    router = 0.5 * torch.randn(EXPERTS, H, generator=generator, dtype=torch.float64)
    experts = [
        0.3 * torch.randn(H, H, generator=generator, dtype=torch.float64) for _ in range(EXPERTS)
    ]
    params = {"router.weight": _param(router)}
    for e in mine:
        params[f"experts.{e}.weight"] = _param(experts[e], allreduce=False)
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    for step in range(ctx.steps):
        x = ctx.batch(step).chunk(dp, dim=0)[dp_rank].reshape(-1, H)
        probs = torch.softmax(x @ params["router.weight"].T, dim=-1)
        choice = probs.argmax(dim=-1)
        gate = probs.gather(1, choice[:, None])[:, 0]
        # Dispatch: every ep peer sees every token of the ep group (all-gather dispatcher).
        x_all = _Gather.apply(x, ep_group, 0)
        choice_all = _Gather.apply(choice.double(), ep_group, 0).long()
        if bug == "router_grad_misses_other_ep_ranks":
            gate_all = _gather_keeping_only_mine(gate, ep_group)
        else:
            gate_all = _Gather.apply(gate, ep_group, 0)
        out = torch.zeros_like(x_all)
        for e in mine:
            hit = choice_all == e
            weight = params[f"experts.{e}.weight"]
            out = out + torch.where(hit[:, None], gate_all[:, None] * (x_all @ weight.T), 0.0)
        y = _Scatter.apply(out, ep_group, 0)  # combine: each token's owner summed back to it
        loss = (y * y).mean()
        loss.backward()
        for p in params.values():
            expert = getattr(p, "allreduce", True) is False
            if expert and bug != "experts_reduced_over_dense_dp":
                # Expert gradients: summed over the ranks holding the same experts, then the
                # same mean over the dense data-parallel ranks as every other gradient.
                dist.all_reduce(p.grad, group=expert_dp_group)
            else:
                dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=dp_group)
        ctx.record(params, loss=logged / dp)
        optimizer.step()
        optimizer.zero_grad()
    return params


def _gather_keeping_only_mine(x: torch.Tensor, group: Any) -> torch.Tensor:
    """A hand-rolled all-gather: the peers' parts arrive as plain data, so no gradient goes
    back to them; only this rank's own part stays in the autograd graph."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = x
    return torch.cat(parts)
