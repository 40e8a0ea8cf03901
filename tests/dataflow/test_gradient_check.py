"""assert_gradient_sync after a real step: DDP, FSDP2 (FSDP and HSDP meshes) and a TP layer.

Every test trains on real process groups; the wrong cases reduce over a strict subset of the
gradient group and must fail, the right ones must pass, on the threaded tier and on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import meshsim
from meshsim import DataflowMismatch
from meshsim.dataflow import loss_scale

# torch convention: (dp, cp, tp) = (2, 2, 2); gradients reduce over dp x cp.
EXP = meshsim.expect(
    "torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"), ops=["flatten dp,cp"]
)
EXP_HSDP = meshsim.expect(
    "olmo-core", 8, dp="hsdp", num_replicas=2, cp=2, tp=2
)  # gradient group: (dp_replicate, dp_cp)


def _step(wrapper: str, over: str) -> str | None:
    """Train one step with every rank loading the SAME input: only the loss scale differs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    grad_mesh = {"dp_cp": mesh["dp", "cp"]._flatten("dp_cp"), "dp": mesh["dp"]}[over]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=torch.float64),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 4, dtype=torch.float64),
    )
    if wrapper == "ddp":
        model = DistributedDataParallel(model, process_group=grad_mesh.get_group())
    else:
        if wrapper == "fsdp+tp":
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if wrapper == "hsdp":
            grad_mesh = mesh["dp", "cp"] if over == "dp_cp" else mesh["dp"]
        fully_shard(model, mesh=grad_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 10
    (model(x).square().mean() * loss_scale()).backward()
    optimizer.step()
    try:
        meshsim.assert_gradient_sync(model, EXP)
    except DataflowMismatch as error:
        return str(error)
    return None


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp+tp", "hsdp"])
def test_reduced_over_the_gradient_group_passes(backend: str, wrapper: str) -> None:
    assert list(meshsim.run(_step, 8, backend=backend, args=(wrapper, "dp_cp"))) == [None] * 8


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp+tp", "hsdp"])
def test_a_missing_member_is_caught_by_the_loss_scale(backend: str, wrapper: str) -> None:
    # Same input on every rank: without distinct loss scales the halves would agree.
    findings = list(meshsim.run(_step, 8, backend=backend, args=(wrapper, "dp")))
    assert all(f is not None for f in findings)
    assert "CP peers 0 and 2 share gradient group (0, 2, 4, 6)" in findings[0]
    assert "different gradients (ranks 0, 4 agree; ranks 2, 6 agree)" in findings[0]


def test_different_initial_weights_are_caught_even_when_gradients_agree() -> None:
    def body() -> str:
        # cp peers differ; dp peers agree.
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_((dist.get_rank() // 2) % 2)  # the cp coordinate
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        try:
            meshsim.assert_gradient_sync(model, EXP)
        except DataflowMismatch as error:
            return str(error)
        return ""

    findings = meshsim.run(body, 8, backend="threaded")
    assert "different parameters" in findings[0] and "different init seeds" in findings[0]


def test_no_gradient_is_a_finding_not_a_pass() -> None:
    def body() -> str:
        try:
            meshsim.assert_gradient_sync(torch.nn.Linear(2, 2), EXP)
        except DataflowMismatch as error:
            return str(error)
        return ""

    assert "call after loss.backward()" in meshsim.run(body, 8, backend="threaded")[0]
