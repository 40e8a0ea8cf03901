"""Released torch behaviour that a finding in docs/findings.md rests on, pinned on real gloo
ranks. Released code wins: when one of these fails after a torch upgrade, torch changed, and
the finding's write-up (and the own step that reports it) must follow."""

from __future__ import annotations

import pytest

import meshsim

pytest.importorskip("torch")


def _gradient_through_local_map(rows: int, async_op: bool) -> tuple[bool, float, float]:
    """torchtitan's full_dtensor attention in miniature: keys sharded over the sequence (dim 1)
    are all-gathered by an async redistribute at a ``local_map`` boundary, whose grad
    placement is Partial. Returns (whether the local keys require grad, the keys' gradient
    norm, the norm without the all-gather's async wrapper in the way)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import local_map

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    seen: list[bool] = []

    def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        seen.append(k.requires_grad)
        return q * k.sum(dim=1, keepdim=True)

    attention = local_map(
        attend,
        out_placements=[Shard(1)],
        in_placements=([Shard(1)], [Replicate()]),
        in_grad_placements=([Shard(1)], [Partial()]),
        device_mesh=mesh,
    )
    norms = []
    data = torch.randn(rows, 4, 2, 3)
    for wait_first in (False, True):
        keys = data.clone().requires_grad_()
        q = DTensor.from_local(keys * 2.0, mesh, [Shard(1)])
        k = DTensor.from_local(keys * 1.0, mesh, [Shard(1)])
        gathered = k.redistribute(placements=[Replicate()], async_op=async_op and not wait_first)
        attention(q, gathered).to_local().sum().backward()
        norms.append(float(keys.grad.norm()))
    return seen[0], norms[0], norms[1]


def test_local_map_drops_the_gradient_of_an_async_gathered_input_of_one_row() -> None:
    """torch's ``local_map`` waits on an ``AsyncCollectiveTensor`` input with ``.wait()``,
    which returns the collective's raw result, off the autograd graph. An async
    ``redistribute`` hands such a tensor to ``to_local()`` when the all-gather needs no
    reordering: a gather along dim 1 of a tensor whose dim 0 has size 1. So with one row
    the keys' gradient is silently dropped (here half the total: the path through the
    queries keeps its half); with two rows, or a synchronous redistribute, it is whole.
    This is what makes torchtitan's full_dtensor context parallelism lose its keys' and
    values' gradients with one row a rank or a pipeline microbatch of one row
    (docs/findings.md). Checked on torch 2.13 and 2.15."""
    requires_grad, dropped, whole = meshsim.run(
        _gradient_through_local_map, 2, "gloo", args=(1, True)
    )[0]
    assert not requires_grad
    assert dropped == pytest.approx(whole / 2)
    for rows, async_op in ((2, True), (1, False)):
        requires_grad, norm, whole = meshsim.run(
            _gradient_through_local_map, 2, "gloo", args=(rows, async_op)
        )[0]
        assert requires_grad and norm == pytest.approx(whole), (rows, async_op)
