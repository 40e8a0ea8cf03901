"""Which group reduced each gradient: real steps on real groups, each wrong wiring beside its twin.

Every body runs a real step on the threaded tier and on gloo, traces it with ``GradientTrace``
and returns the rank's trace; the parent checks the traces against the reference. A wrong
case must name the parameter, the group observed and the kind needed; its twin must pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim.errors import NothingCompared, ReductionMismatch, UsageError
from meshsim.usage.param_roles import Marks, needed_kinds, param_roles
from meshsim.usage.reduction_check import assert_gradient_reductions, check_reductions
from meshsim.usage.trace import GradientTrace
from meshsim.usage.trace_records import Collective, ParamTrace, RankTrace

BACKENDS = ["threaded", "gloo"]
# Megatron, tp=2 on 4 ranks: dp-cp (0, 2), (1, 3); tp (0, 1), (2, 3).
MEGATRON_TP = meshsim.expect("megatron", 4, tensor_model_parallel_size=2)
# Megatron, ep=2 on 4 ranks: dense dp-cp (0, 1, 2, 3); expert:dp (0, 2), (1, 3).
MEGATRON_EP = meshsim.expect("megatron", 4, expert_model_parallel_size=2)
# torch (dp, tp) = (2, 2): gradients reduce over dp (0, 2), (1, 3).
TORCH_DP_TP = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
# torch HSDP (dp_replicate, dp_shard) = (2, 2): gradients reduce over their product (the world).
TORCH_HSDP = meshsim.expect(
    "torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp_replicate", "dp_shard")
)
HERE = __file__.rsplit("/", 1)[-1]


def _megatron_groups(expected: meshsim.Expected, *kinds: str) -> dict[str, Any]:
    """This rank's group of each kind, every group created on every rank (as Megatron does)."""
    mine = {}
    for kind in kinds:
        for group in expected.groups(kind):
            created = dist.new_group(list(group))
            if dist.get_rank() in group:
                mine[kind] = created
    return mine


class _Weight(torch.nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64) * 0.1)


# ---------------------------------------------------------------------------- (a) TP + SP


class _GatherSequence(torch.autograd.Function):
    """Sequence-parallel all-gather over tp; its backward is a reduce-scatter (all-reduce, keep
    this rank's slice: gloo's reduce-scatter is newer than the oldest supported torch)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _ScatterSequence(torch.autograd.Function):
    """Row-parallel output: reduce-scatter over tp along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        full = partial.clone()
        dist.all_reduce(full, group=group)
        return full.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class _SequenceParallelBlock(torch.nn.Module):
    """A norm weight replicated over tp (sequence parallel), a column- and a row-parallel
    linear, each tp rank holding its shards as plain tensors, Megatron style."""

    def __init__(self, tp: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tp = tp
        self.norm = _Weight(4)
        self.norm.weight.sequence_parallel = True  # Megatron's mark
        self.fc1 = _Weight(8 // 2, 4)  # column shard
        self.fc2 = _Weight(4, 8 // 2)  # row shard

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        full = _GatherSequence.apply(local * self.norm.weight, self.tp)
        hidden = torch.relu(full @ self.fc1.weight.T)
        return _ScatterSequence.apply(hidden @ self.fc2.weight.T, self.tp)


def _tp_sp_step(reduce_norm_over_tp: bool, stray: bool = False) -> RankTrace:
    rank = dist.get_rank()
    groups = _megatron_groups(MEGATRON_TP, "tp", "dp-cp")
    block = _SequenceParallelBlock(groups["tp"])
    local = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with GradientTrace() as trace:
        (block(local).square().sum() * (rank + 1)).backward()
        for param in block.parameters():  # the data-parallel reduction (DDP's job)
            dist.all_reduce(param.grad, group=groups["dp-cp"])  # dp reduction
        if reduce_norm_over_tp:  # as finalize_model_grads does for sequence-parallel weights
            dist.all_reduce(block.norm.weight.grad, group=groups["tp"])  # tp reduction
        if stray:
            pairs = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            dist.all_reduce(torch.ones(1), group=pairs[rank in (1, 2)])  # stray
    return trace.result(block)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_norm_reduced_over_tp_passes(backend: str) -> None:
    traces = meshsim.run(_tp_sp_step, 4, backend=backend, args=(True,))
    assert check_reductions(traces, MEGATRON_TP) == []
    norm = next(p for p in traces[0].params if p.name == "norm.weight")
    assert [c.group for c in norm.reductions] == [(0, 2), (0, 1)]
    # The activation reductions of the forward/backward are not the gradient's.
    assert all(c.site and HERE in c.site for c in norm.reductions)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_norm_missing_its_tp_reduction_is_caught(backend: str) -> None:
    traces = meshsim.run(_tp_sp_step, 4, backend=backend, args=(False,))
    with pytest.raises(ReductionMismatch) as caught:
        assert_gradient_reductions(traces, MEGATRON_TP)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("`norm.weight` on ranks 0-3: gradient reduced over dp-cp [0, 2]")
    assert "needs dp-cp [0, 2] and tp [0, 1] (sequence parallel:" in first
    assert len(caught.value.problems) == 1  # fc1 and fc2 are tp-sharded: dp-cp is all they need


def test_roles_win_over_the_marks() -> None:
    traces = meshsim.run(_tp_sp_step, 4, backend="threaded", args=(True,))
    # Told it is dense, the norm weight's extra tp reduction is a finding.
    problems = check_reductions(traces, MEGATRON_TP, roles={"norm.weight": "dense"})
    assert problems == [
        "`norm.weight` on ranks 0-3: gradient reduced over dp-cp [0, 2] (all_reduce at "
        f"tests/usage/{HERE}:{_line('# dp reduction')}) and tp [0, 1] (all_reduce at "
        f"tests/usage/{HERE}:{_line('# tp reduction')}), needs dp-cp [0, 2] "
        "(dense: reduced over the gradient group)"
    ]
    # Told every fc weight is sequence parallel, they miss the tp reduction.
    problems = check_reductions(traces, MEGATRON_TP, roles={"fc*": "sequence_parallel"})
    assert len(problems) == 1 and problems[0].startswith("`fc1.weight`, `fc2.weight` on ranks")


# ---------------------------------------------------------------------------- (b) experts


def _expert_step(expert_kind: str) -> RankTrace:
    """Dense and expert weights' gradients live in one Megatron-style grad buffer
    (``main_grad`` views); each bucket (a slice of it) is all-reduced over its group."""
    rank = dist.get_rank()
    groups = _megatron_groups(MEGATRON_EP, "dp-cp", "expert:dp")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.dense = _Weight(3, 4)
    model.experts = _Weight(2, 3)
    model.experts.weight.allreduce = False  # Megatron's expert mark
    buffer = torch.zeros(12 + 6, dtype=torch.float64)
    model.dense.weight.main_grad = buffer[:12].view(3, 4)
    model.experts.weight.main_grad = buffer[12:].view(2, 3)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with GradientTrace() as trace:
        (model.experts.weight @ (model.dense.weight @ x.T)).square().sum().backward()
        for param in model.parameters():
            param.main_grad.add_(param.grad)
            param.grad = None  # Megatron keeps only main_grad
        dist.all_reduce(buffer[:12], group=groups["dp-cp"])  # the dense bucket
        dist.all_reduce(buffer[12:], group=groups[expert_kind])  # the expert bucket
    return trace.result(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_grads_over_the_expert_data_group_pass(backend: str) -> None:
    traces = meshsim.run(_expert_step, 4, backend=backend, args=("expert:dp",))
    assert check_reductions(traces, MEGATRON_EP) == []
    by_name = {p.name: p.reductions for p in traces[0].params}
    assert [c.group for c in by_name["dense.weight"]] == [(0, 1, 2, 3)]  # its bucket only
    assert [c.group for c in by_name["experts.weight"]] == [(0, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_grads_over_the_dense_group_are_caught(backend: str) -> None:
    traces = meshsim.run(_expert_step, 4, backend=backend, args=("dp-cp",))
    problems = check_reductions(traces, MEGATRON_EP)
    assert len(problems) == 1
    assert problems[0].startswith(
        "`experts.weight` on ranks 0-3: gradient reduced over dp-cp [0, 1, 2, 3] (all_reduce at"
    )
    assert "needs expert:dp [0, 2] (expert: reduced over the ranks holding the same" in problems[0]


# ---------------------------------------------------------------------------- (c) DDP


def _ddp_step(over: str) -> RankTrace:
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    groups = _megatron_groups(MEGATRON_TP, "dp-cp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, dtype=torch.float64))
    group = groups["dp-cp"] if over == "dp-cp" else None  # None: the world
    ddp = DistributedDataParallel(model, process_group=group)
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with GradientTrace() as trace:
        if over == "no_sync":
            with ddp.no_sync():
                ddp(x).sum().backward()
        else:
            ddp(x).sum().backward()
    return trace.result(ddp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_over_the_gradient_group_passes(backend: str) -> None:
    traces = meshsim.run(_ddp_step, 4, backend=backend, args=("dp-cp",))
    assert check_reductions(traces, MEGATRON_TP) == []
    assert [c.group for c in traces[1].params[0].reductions] == [(1, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_over_the_world_is_caught(backend: str) -> None:
    traces = meshsim.run(_ddp_step, 4, backend=backend, args=("world",))
    problems = check_reductions(traces, MEGATRON_TP)
    assert problems == [
        "`module.0.weight`, `module.0.bias` on ranks 0-3: gradient reduced over tp-dp-cp "
        "[0, 1, 2, 3] (all_reduce by DistributedDataParallel (read from the wrapper)), needs "
        "dp-cp [0, 2] (dense: reduced over the gradient group)"
    ]


def test_ddp_under_no_sync_reduces_nothing() -> None:
    traces = meshsim.run(_ddp_step, 4, backend="threaded", args=("no_sync",))
    problems = check_reductions(traces, MEGATRON_TP)
    assert len(problems) == 1
    assert "gradient not reduced at all, needs dp-cp [0, 2]" in problems[0]
    assert problems[0].endswith("DistributedDataParallel's last forward ran under no_sync()")


# ---------------------------------------------------------------------------- (d) FSDP2


def _fsdp_step(dims: tuple[str, str], shard_over: str | None) -> RankTrace:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6, dtype=torch.float64),
        torch.nn.ReLU(),
        torch.nn.Linear(6, 2, dtype=torch.float64),
    )
    fully_shard(model, mesh=mesh if shard_over is None else mesh[shard_over])
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with GradientTrace() as trace:
        model(x).square().sum().backward()  # fsdp backward
    return trace.result(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_over_the_dp_mesh_passes(backend: str) -> None:
    traces = meshsim.run(_fsdp_step, 4, backend=backend, args=(("dp", "tp"), "dp"))
    assert check_reductions(traces, TORCH_DP_TP) == []
    (reduce_scatter,) = traces[0].params[0].reductions
    assert reduce_scatter.op.startswith("reduce_scatter") and reduce_scatter.group == (0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_over_the_wrong_mesh_dim_is_caught(backend: str) -> None:
    traces = meshsim.run(_fsdp_step, 4, backend=backend, args=(("dp", "tp"), "tp"))
    problems = check_reductions(traces, TORCH_DP_TP)
    assert len(problems) == 1
    assert problems[0].startswith("`0.weight`, `0.bias`, `2.weight` and 1 more on ranks 0-3: ")
    assert "gradient reduced over tp [0, 1] (reduce_scatter" in problems[0]
    assert f"at tests/usage/{HERE}:{_line('# fsdp backward')}" in problems[0]
    assert "needs dp [0, 2] (dense" in problems[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hsdp_reduce_scatter_then_all_reduce_makes_the_product_group(backend: str) -> None:
    dims = ("dp_replicate", "dp_shard")
    traces = meshsim.run(_fsdp_step, 4, backend=backend, args=(dims, None))
    assert check_reductions(traces, TORCH_HSDP) == []
    assert [c.group for c in traces[0].params[0].reductions] == [(0, 1), (0, 2)]
    # FSDP over the shard dim alone reaches half of the gradient group.
    traces = meshsim.run(_fsdp_step, 4, backend=backend, args=(dims, "dp_shard"))
    (problem,) = check_reductions(traces, TORCH_HSDP)
    assert "gradient reduced over dp_shard [0, 1]" in problem
    assert "needs dp_replicate×dp_shard [0, 1, 2, 3]" in problem


def _fsdp_accumulating_step(sync: bool) -> RankTrace:
    """The traced step's gradient is accumulated into the previous micro-batch's, a storage
    no traced call touched: FSDP2's state names its groups, a recorded call confirms them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 2, dtype=torch.float64), mesh=mesh["dp"])
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # the first micro-batch, not traced
    with GradientTrace() as trace:
        model.set_requires_gradient_sync(sync)
        model(x).sum().backward()
    return trace.result(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_accumulated_grads_are_matched_by_the_wrappers_groups(backend: str) -> None:
    traces = meshsim.run(_fsdp_accumulating_step, 4, backend=backend, args=(True,))
    assert check_reductions(traces, TORCH_DP_TP) == []
    assert [c.group for c in traces[0].params[0].reductions] == [(0, 2)]
    # Without gradient sync FSDP2 reduces nothing, and nothing is claimed for it.
    traces = meshsim.run(_fsdp_accumulating_step, 4, backend=backend, args=(False,))
    (problem,) = check_reductions(traces, TORCH_DP_TP)
    assert problem.startswith("`weight`, `bias` on ranks 0-3: gradient not reduced at all")


# ---------------------------------------------------------------------------- (e) strays


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_collective_over_a_group_the_layout_lacks_is_reported_with_its_line(
    backend: str,
) -> None:
    traces = meshsim.run(_tp_sp_step, 4, backend=backend, args=(True, True))
    problems = check_reductions(traces, MEGATRON_TP)
    assert problems == [
        f"all_reduce at tests/usage/{HERE}:{_line('# stray')} runs over a group the layout does "
        "not define: [0, 3] on ranks 0, 3; [1, 2] on ranks 1, 2"
    ]
    # ... and not when the same call runs over a group the layout has.
    traces = meshsim.run(_tp_sp_step, 4, backend=backend, args=(True,))
    assert check_reductions(traces, MEGATRON_TP) == []


# ---------------------------------------------------------------------------- DTensor


def _dtensor_step(redistribute: bool) -> RankTrace:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(4, dtype=torch.float64),
        torch.nn.Linear(4, 6, dtype=torch.float64),
        torch.nn.Linear(6, 4, dtype=torch.float64),
    )
    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "2": RowwiseParallel(),
    }
    parallelize_module(model, mesh["tp"], plan)
    x = torch.randn(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with GradientTrace() as trace:
        model(x).square().sum().backward()
        for param in model.parameters():
            if redistribute and any(p.is_partial() for p in param.grad.placements):
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(param.grad.to_local(), group=mesh["dp"].get_group())
    return trace.result(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtensor_partial_grads_resolved_over_tp_are_attributed(backend: str) -> None:
    sequence_parallel = {"0.*": "sequence_parallel"}
    traces = meshsim.run(_dtensor_step, 4, backend=backend, args=(True,))
    assert check_reductions(traces, TORCH_DP_TP, roles=sequence_parallel) == []
    norm = next(p for p in traces[0].params if p.name == "0.weight")
    assert [(c.op, c.group) for c in norm.reductions] == [
        ("all_reduce (functional)", (0, 1)),
        ("all_reduce", (0, 2)),
    ]
    # Left Partial, the norm's gradients miss their tp reduction.
    traces = meshsim.run(_dtensor_step, 4, backend=backend, args=(False,))
    (problem,) = check_reductions(traces, TORCH_DP_TP, roles=sequence_parallel)
    assert problem.startswith("`0.weight`, `0.bias` on ranks 0-3: gradient reduced over dp [0, 2]")
    assert "needs dp [0, 2] and tp [0, 1]" in problem


def test_dtensor_own_reduction_is_not_a_need_of_a_dense_weight() -> None:
    # Without roles the norm weight is dense: DTensor resolving its Partial gradient over tp
    # (a dim it is Replicate on) is accepted, not reported as an extra reduction.
    traces = meshsim.run(_dtensor_step, 4, backend="threaded", args=(True,))
    assert check_reductions(traces, TORCH_DP_TP) == []


# ---------------------------------------------------------------------------- pure policy


def test_needed_kinds_read_megatron_marks() -> None:
    exp = meshsim.expect("megatron", 8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert needed_kinds("w", Marks(), exp) == ("dp-cp",)
    assert needed_kinds("w", Marks(allreduce=False), exp) == ("expert:dp",)
    assert needed_kinds("w", Marks(sequence_parallel=True), exp) == ("dp-cp", "tp")
    assert needed_kinds("w", Marks(shared_embedding=True), exp) == ("dp-cp", "embedding")
    # Names are not read: Megatron's shared experts are dense.
    assert param_roles("mlp.shared_experts.fc1.weight", Marks()) == ("dense",)
    assert param_roles("mlp.experts.fc1.weight", Marks(), {"*.experts.*": "expert"}) == ("expert",)
    with pytest.raises(UsageError, match="each role is one of"):
        param_roles("w", Marks(), {"w": "replicated"})


def test_an_unreduced_layout_proves_nothing_and_bad_input_is_refused() -> None:
    single = meshsim.expect("megatron", 2, tensor_model_parallel_size=2)  # dp-cp of one rank
    trace = RankTrace(0, 2, (ParamTrace("w", Marks(), ()),), ())
    with pytest.raises(NothingCompared):
        check_reductions([trace, RankTrace(1, 2, (), ())], single)
    with pytest.raises(UsageError, match="GradientTrace"):
        check_reductions([None], single)  # type: ignore[list-item]
    with pytest.raises(UsageError, match="world of \\[2\\] ranks"):
        check_reductions([trace], MEGATRON_TP)


def test_twice_over_one_group_is_a_finding() -> None:
    twice = (Collective("all_reduce", (0, 2), "a.py:1"), Collective("all_reduce", (0, 2), "a.py:2"))
    traces = [RankTrace(r, 4, (ParamTrace("w", Marks(), twice),), ()) for r in (0,)]
    (problem,) = check_reductions(traces, MEGATRON_TP)
    assert problem.startswith("`w` on rank 0: gradient reduced twice over the same group: dp-cp")


def test_a_tied_embedding_needs_the_embedding_group_too() -> None:
    # Megatron pp=2 on 4 ranks: dp-cp (0, 1), (2, 3); embedding (first and last stage) (0, 2).
    exp = meshsim.expect("megatron", 4, pipeline_model_parallel_size=2)
    tied = Marks(shared=True)
    dp = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    embd = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}

    def traces(*kinds: dict[int, tuple[int, ...]]) -> list[RankTrace]:
        out = []
        for rank in range(4):
            calls = tuple(Collective("all_reduce", groups[rank], None) for groups in kinds)
            out.append(RankTrace(rank, 4, (ParamTrace("embedding.weight", tied, calls),), ()))
        return out

    assert check_reductions(traces(dp, embd), exp) == []
    (problem,) = check_reductions(traces(dp), exp)
    assert problem.startswith("`embedding.weight` on ranks 0-3: gradient reduced over dp-cp")
    assert "needs dp-cp [0, 1] and embedding [0, 2] (tied embedding:" in problem


def _line(marker: str) -> int:
    """The line of this file holding ``marker`` (the sites the reports must name)."""
    with open(__file__) as source:
        for number, text in enumerate(source, start=1):
            if marker in text and "_line(" not in text:
                return number
    raise AssertionError(marker)
