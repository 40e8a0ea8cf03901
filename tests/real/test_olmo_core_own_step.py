"""OLMo-core 3.0.0's own training step against its serial twin (``meshsim.own_steps``).

The step is OLMo-core's: its ``TransformerTrainModule`` on the olmo2_1M model, parallelized
by its own ``apply_fsdp`` / ``apply_tp``, its loss, clipping and ``SkipStepAdamW``. Passing
layouts must pass; bugs planted in copies of OLMo-core's own functions (through the step's
``before`` hook, inside every rank) must fail, naming the parameter and the likely mistake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshsim.errors import SerialMismatch, UsageError
from meshsim.usage.recipe import check_equivalence
from tests.real._helpers import require

pytestmark = [require("olmo-core", "olmo_core"), pytest.mark.requires_framework("olmo-core")]

FSDP = {"dp": "fsdp"}
FSDP_TP = {"dp": "fsdp", "tp": 2}


#: What the planted bugs below replace (module globals and class attributes).
PATCHED = (
    "olmo_core.train.train_module.transformer.train_module",
    "olmo_core.train.train_module.transformer.train_module:TransformerTrainModule",
    "olmo_core.nn.lm_head:LMHead",
    "olmo_core.nn.moe.router",
    "olmo_core.nn.moe.router:MoERouter",
    "olmo_core.nn.moe.mlp:MoEMLP",
    "olmo_core.nn.moe.mlp:MoEMLPBase",
)


@pytest.fixture(autouse=True)
def _olmo_restored() -> Iterator[None]:
    """Threaded ranks share this process: put back what a planted bug replaced."""
    from meshsim.builders.real import _shims
    from meshsim.own_steps import put_back

    _shims.load("olmo_core", "olmo_core.train.train_module.transformer.train_module")
    with put_back(lambda: None, PATCHED):
        yield


def _planted(world: int, config: dict[str, Any], before: Any | None) -> Any:
    from meshsim.own_steps import olmo_core as own
    from meshsim.usage.serial import assert_matches_serial

    return assert_matches_serial(
        own.step(config, before=before), world, "olmo-core", backend="threaded",
        batch=own.batch, timeout=300, **config,
    )  # fmt: skip


@pytest.mark.parametrize("config", [FSDP, FSDP_TP], ids=["fsdp", "fsdp+tp"])
def test_olmo_cores_own_step_matches_its_serial_twin(config: dict[str, Any]) -> None:
    result = check_equivalence("olmo-core", 2, "threaded", real=True, timeout=300, **config)
    assert result.passed, result.error
    assert "TransformerTrainModule.train_batch" in result.step
    assert "478 tensors over 2 steps" in result.summary


def _clip_with_local_norm() -> None:
    """OLMo-core's ``_clip_grad_norm`` taking the norm of each rank's own shards (no
    ``full_tensor()`` of a norm over local tensors): each rank clips by its own norm."""
    import torch
    from olmo_core.distributed.utils import get_local_tensor
    from olmo_core.train.train_module.transformer import train_module

    def _clip_grad_norm(self: Any, max_grad_norm: float, norm_type: float = 2.0, foreach=None):
        parameters = list(self.model.parameters())
        grads = [get_local_tensor(p.grad) for p in parameters if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, total_norm)
        return total_norm

    train_module.TransformerTrainModule._clip_grad_norm = _clip_grad_norm


def test_a_clipping_norm_from_local_shards_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP, _clip_with_local_norm)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `"), first
    assert "the logged `grad_norm` at step 1 differs between ranks" in first, first
    assert "a clipping norm from each rank's own shards" in first, first


def _world_as_data_parallel_group() -> None:
    """OLMo-core's train module asking for the world group where it needs the data-parallel
    group: under TP, its two TP peers each take half of the global batch."""
    import torch.distributed as dist
    from olmo_core.train.train_module.transformer import train_module

    train_module.get_dp_process_group = lambda mesh: dist.group.WORLD


def test_tensor_parallel_peers_fed_different_rows_are_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, FSDP_TP, _world_as_data_parallel_group)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `"), first
    assert "a different batch" in first or "differs from the serial one" in first, first


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"dp": "fsdp", "pp": 2}, r"pp=2: .*only its custom schedules.*torch\.cuda\.Stream"),
        (
            {"dp": "hsdp", "num_replicas": 1, "cp": 2, "ep": 2},
            r"ep=2 and cp=2: its MoE's load-balancing loss",
        ),
        ({"expert_mesh_ep": 2}, r"expert_mesh_ep=2: build_expert_parallel_mesh"),
    ],
    ids=["pp", "ep+cp", "expert-mesh"],
)
def test_layouts_the_step_does_not_run_are_refused_with_the_reason(
    config: dict[str, Any], reason: str
) -> None:
    with pytest.raises(UsageError, match=reason):
        check_equivalence("olmo-core", 4, "threaded", real=True, **config)


def test_ddp_over_a_tensor_parallel_model_trains_nothing() -> None:
    """A finding in OLMo-core 3.0.0 with torch 2.13 (and 2.15): ``apply_ddp`` uses torch's
    ``replicate``, whose DDP+TP work-around swaps the model's DTensor parameters for local
    ones at the first forward (pytorch/pytorch#152712). The optimizer, built before, holds
    the originals: they never get a gradient, and nothing trains."""
    result = check_equivalence("olmo-core", 2, "threaded", real=True, timeout=300, dp="ddp", tp=2)
    assert not result.passed
    first = result.error.splitlines()[0]
    assert first.startswith("`embeddings.weight` (grads) is in the serial step but no rank"), first
    assert "not the tensor the model trains with" in first


# -- context parallelism (OLMo's Ulysses style) ----------------------------------------------------

CP = {"dp": "fsdp", "cp": 2}


def test_context_parallel_step_matches_its_serial_twin() -> None:
    result = check_equivalence("olmo-core", 2, "threaded", real=True, timeout=300, **CP)
    assert result.passed, result.error


def _cp_share_not_scaled() -> None:
    """OLMo-core's ``LMHead._finalize_loss`` without its context-parallel adjustment: each CP
    rank divides its sequence shard's summed loss by the whole batch's token count, so its
    share of the loss is 1/cp of what OLMo gives it (the TP branch is left out: no TP here)."""
    from olmo_core.nn.lm_head import LMHead

    def _finalize_loss(self, loss, B, *, loss_reduction, loss_div_factor=None, **_):
        if loss_div_factor is not None:
            loss = loss / loss_div_factor
        return loss

    LMHead._finalize_loss = _finalize_loss


def test_a_context_parallel_loss_share_not_scaled_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, CP, _cp_share_not_scaled)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `embeddings.weight` at step 1"), first
    assert "the logged `loss` at step 1 is 0.5x (1/2) the serial one" in first, first


# -- expert parallelism (small_hybrid_moe, HSDP with ep = the shard degree) ------------------------

EP = {"dp": "hsdp", "num_replicas": 1, "ep": 2}
EXPERTS = "feed_forward_moe.experts.mlp.w"


def test_expert_parallel_step_differs_from_its_twin_in_the_expert_gradients_only() -> None:
    """A finding in OLMo-core 3.0.0 (docs/findings.md, "expert parallelism scales the experts'
    gradients by ep"):
    with ``ep`` = 2 every dense gradient, the loss, the load-balancing and z losses match the
    serial twin, and the routed experts' gradients are 2x (ep x) the twin's, at world 2 and at
    world 4 (HSDP 2 x 2). Each rank's experts receive, through OLMo's all-to-all, the gradients
    of every ep peer's tokens, each normalised by its own rank's token count; the experts' FSDP
    averages over ``dp_replicate`` only. (OLMo-core scaled the experts' gradients by 1 / ep in
    ``MoEMLPBase._shard_experts`` until its PR #246, 2025-04.) The test pins the behaviour the
    check reports."""
    with pytest.raises(SerialMismatch) as info:
        _planted(2, EP, None)
    problems = info.value.problems
    assert all(EXPERTS in line for line in problems), problems
    first = problems[0]
    assert first.startswith(f"grad of `blocks.0.{EXPERTS}1` at step 1"), first
    assert "is 2x the serial one" in first, first


def _expert_gradients_scaled_by_ep() -> None:
    """OLMo-core's ``MoEMLP.forward`` with the gradient reaching the local experts scaled by
    1 / ep, as megablocks (which it was adapted from) scaled it; its comment "Scale gradients"
    is still there, the scaling is not."""
    import torch
    import torch.nn.functional as F
    from olmo_core.distributed.utils import get_local_tensor
    from olmo_core.nn.moe.mlp import MoEMLP

    class _Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, scale: float) -> Any:
            ctx.scale = scale
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad * ctx.scale, None

    def forward(self: Any, x: Any) -> Any:
        og_dtype = x.dtype
        scale = 1.0 / (1 if self.ep_mesh is None else self.ep_mesh.size())
        e, d, h = self.num_experts, self.d_model, self.hidden_size
        w1, w2, w3 = (
            _Scaled.apply(get_local_tensor(w.view(*shape)), scale)
            for w, shape in ((self.w1, (e, d, h)), (self.w2, (e, h, d)), (self.w3, (e, d, h)))
        )
        x = x.type_as(w1)
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2).to(dtype=og_dtype)

    MoEMLP.forward = forward


def test_expert_parallel_step_matches_its_twin_with_expert_gradients_scaled_by_ep() -> None:
    """The one difference above, and only it: with the experts' gradients scaled by 1 / ep the
    expert-parallel step matches its serial twin in every gradient, weight and logged value."""
    summary = str(_planted(2, EP, _expert_gradients_scaled_by_ep))
    assert "over 2 steps" in summary, summary


def _load_balancing_loss_over_its_micro_batch() -> None:
    """On top of the scaling above: OLMo-core's ``load_balancing_loss`` (granularity
    local_batch, no TP or CP) normalised by the micro-batch's own token count instead of the
    ``loss_div_factor`` the model hands it (the rank's batch token count)."""
    import torch
    from olmo_core.nn.moe import router

    _expert_gradients_scaled_by_ep()

    def load_balancing_loss(*, num_experts, top_k, expert_scores, batch_size_per_expert, **_):
        B, S, _ = expert_scores.shape
        scores = expert_scores.view(-1, num_experts).mean(dim=0)
        loss = torch.dot(batch_size_per_expert.type_as(scores), scores) / (B * S)
        return num_experts / top_k * loss

    router.load_balancing_loss = load_balancing_loss


def test_a_load_balancing_loss_normalised_per_micro_batch_is_named() -> None:
    with pytest.raises(SerialMismatch) as info:
        _planted(2, EP, _load_balancing_loss_over_its_micro_batch)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `embeddings.weight` at step 1"), first
    assert "the logged `load_balancing_loss` at step 1 is 0.5x (1/2) the serial one" in first


def _experts_exchanged_over_the_world_group() -> None:
    """OLMo-core's ``MoEMLPBase._shard_experts`` taking the world group (with HSDP 2 x 2 every
    data-parallel rank) for the experts' all-to-all instead of the ep mesh's group: tokens go
    to ranks that do not hold their experts."""
    import torch.distributed as dist
    import torch.nn as nn
    from olmo_core.nn.moe.mlp import MoEMLPBase
    from torch.distributed.tensor import Shard, distribute_tensor

    def _shard_experts(self: Any, mesh: Any) -> None:
        self.ep_mesh = mesh
        self.ep_pg = dist.group.WORLD
        self.num_local_experts = self.num_experts // mesh.size()
        for name in ("w1", "w2", "w3"):
            weight = distribute_tensor(getattr(self, name), mesh, [Shard(0)])
            self.register_parameter(name, nn.Parameter(weight))

    MoEMLPBase._shard_experts = _shard_experts


@pytest.mark.slow
def test_experts_exchanged_over_the_world_group_are_named() -> None:
    config = {"dp": "hsdp", "num_replicas": 2, "ep": 2}
    with pytest.raises(SerialMismatch) as info:
        _planted(4, config, _experts_exchanged_over_the_world_group)
    first = str(info.value).splitlines()[0]
    assert first.startswith("grad of `"), first
    assert any(line.startswith(f"grad of `blocks.0.{EXPERTS}1`") for line in info.value.problems)


def test_the_cpu_binned_kernels_copy_what_the_triton_kernels_copy() -> None:
    """``olmo_core_cpu.BinnedKernels`` against the triton kernels' per-program rule, written as
    loops: entry ``j < min(capacity, count)`` of expert ``e``'s bin copies row ``index // top_k``
    (times ``weights[index]``) to slot ``(e, j)``; the rest is dropped (here: capacity 3, so
    some experts overflow)."""
    import torch

    from meshsim.own_steps.olmo_core_cpu import BinnedKernels

    torch.manual_seed(0)
    tokens, top_k, experts, capacity, hidden = 16, 2, 4, 3, 5
    x = torch.randn(tokens, hidden)
    weights = torch.rand(tokens * top_k)
    bin_ids, indices = torch.sort(torch.randint(0, experts, (tokens * top_k,)))
    bins = torch.cumsum(torch.bincount(bin_ids, minlength=experts), 0).int()
    slots = []
    for e in range(experts):
        start = 0 if e == 0 else int(bins[e - 1])
        for j in range(min(capacity, int(bins[e]) - start)):
            slots.append((e, j, int(indices[start + j])))

    gathered = torch.zeros(experts, capacity, hidden)
    for e, j, index in slots:
        gathered[e, j] = x[index // top_k] * weights[index]
    got = BinnedKernels.binned_gather(x, indices.int(), weights, bins, capacity, top_k)
    assert torch.equal(got, gathered)

    y = torch.randn(experts, capacity, hidden)
    scattered = torch.zeros(tokens * top_k, hidden)
    for e, j, index in slots:
        scattered[index] = y[e, j] * weights[index]
    got = BinnedKernels.binned_scatter(y, indices.int(), weights, bins, top_k)
    assert torch.allclose(got, scattered.view(tokens, top_k, hidden).sum(1), atol=0, rtol=1e-6)

    grad = torch.randn(tokens, hidden)
    wgrad = torch.zeros(tokens * top_k)
    for e, j, index in slots:
        wgrad[index] = (y[e, j] * grad[index // top_k]).sum()
    got = BinnedKernels.binned_scatter_wgrad(y, grad, indices.int(), bins, top_k)
    assert torch.allclose(got, wgrad, atol=0, rtol=1e-6)
