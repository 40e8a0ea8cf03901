"""A receive into a leaf tensor that requires grad, as ``torch.distributed.pipelining``'s
stages post them for their inputs: every tier fills it (a backend writes outside autograd;
the threaded tier's mailbox once raised "a leaf Variable that requires grad is being used in
an in-place operation")."""

from __future__ import annotations

import pytest

from meshsim.harness import run


def _send_to_a_leaf() -> list[float]:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        sent = torch.arange(3, dtype=torch.float32, requires_grad=True) * 2
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent.detach(), 1)]):
            work.wait()
        return []
    leaf = torch.zeros(3, requires_grad=True)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, leaf, 0)]):
        work.wait()
    assert leaf.is_leaf and leaf.requires_grad
    return leaf.tolist()


@pytest.mark.parametrize("tier", ["threaded", "gloo"])
def test_a_receive_fills_a_leaf_that_requires_grad(tier: str) -> None:
    assert list(run(_send_to_a_leaf, 2, tier, timeout=120)) == [[], [0.0, 2.0, 4.0]]
