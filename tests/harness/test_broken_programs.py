"""No false passes: the same broken programs on every tier, each reported; their twins pass.

Each program takes ``broken``: ``False`` is the correct twin (it must pass on every tier, so
the checks cannot be trivially failing), ``True`` breaks it the way real training code breaks.
Whatever a tier does with the broken program (torch's threaded backend pairs mismatched
collectives and returns, gloo tolerates some mismatches, hangs on others and crashes on
others, the fake backend returns at once), it must report the same thing every time: a
``CollectiveDivergence`` naming the ranks and the calls, never a ``RankFailure`` or
``RankTimeout`` that depends on who lost a race.

The timeout is generous on purpose: it is there only so that a harness regression fails
instead of hanging the suite. A broken program that leaves ranks waiting forever is stopped
as soon as the recordings prove the divergence, so no run here should come near it; the
tests check that the run was stopped (status ``aborted``), not timed out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from meshsim.errors import CollectiveDivergence
from meshsim.harness import run

WORLD = 4
#: Far above what any of these programs needs (under a second each), even on a loaded
#: machine: reaching it means the harness failed to stop a deadlock.
TIMEOUT = 300.0


def mismatched_kind(broken: bool) -> None:
    """Rank 0 all_reduces while the others enter a barrier."""
    import torch
    import torch.distributed as dist

    if broken and dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2))
    elif broken:
        dist.barrier()
    else:
        dist.all_reduce(torch.ones(2))


def wrong_group(broken: bool) -> None:
    """Rank 3 all_reduces on the world while its peers use a group of the same four ranks."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    dist.all_reduce(torch.ones(2), group=None if broken and dist.get_rank() == 3 else group)


def missing_rank(broken: bool) -> None:
    """Rank 3 skips the second all_reduce the others run."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2))
    if not (broken and dist.get_rank() == 3):
        dist.all_reduce(torch.ones(2))


def different_shapes(broken: bool) -> None:
    """Rank 1 all_reduces a tensor of another shape."""
    import torch
    import torch.distributed as dist

    size = 3 if broken and dist.get_rank() == 1 else 2
    dist.all_reduce(torch.ones(size))


def swapped_order(broken: bool) -> None:
    """Rank 2 broadcasts before it all_reduces; the others do it the other way round."""
    import torch
    import torch.distributed as dist

    steps = [lambda: dist.all_reduce(torch.ones(2)), lambda: dist.broadcast(torch.ones(2), 0)]
    for step in reversed(steps) if broken and dist.get_rank() == 2 else steps:
        step()


def unmatched_send(broken: bool) -> None:
    """Rank 0 isends to rank 1, which never receives (gloo lets the message vanish)."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        work = dist.isend(torch.ones(2), 1)
        if not broken:
            work.wait()
    elif dist.get_rank() == 1 and not broken:
        dist.recv(torch.zeros(2), 0)


def wrong_peer(broken: bool) -> None:
    """Rank 0 sends to rank 2 while rank 1 waits for it."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.send(torch.ones(2), 2 if broken else 1)
    elif dist.get_rank() == 1:
        dist.recv(torch.zeros(2), 0)


def mismatched_sizes(broken: bool) -> None:
    """Rank 0 sends 2 elements into rank 1's buffer of 4 (gloo fills half and returns)."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.send(torch.ones(2 if broken else 4), 1)
    elif dist.get_rank() == 1:
        dist.recv(torch.zeros(4), 0)


def batched_ring(broken: bool) -> list[float]:
    """A ring exchange with ``batch_isend_irecv``; rank 3 posts a receive of the wrong dtype."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float64 if broken and rank == 3 else torch.float32
    got = torch.zeros(2, dtype=dtype)
    ops = [
        dist.P2POp(dist.irecv, got, (rank - 1) % world),
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got.tolist()


@dataclass(frozen=True)
class Case:
    """A broken program and what every report of it must name."""

    fn: Callable[[bool], object]
    ranks: tuple[int, ...]  # ranks a CollectiveDivergence must name
    call: str  # what a RankTimeout must name as a stuck rank's call
    text: str = ""  # what a CollectiveDivergence's message must contain


CASES = {
    "mismatched_kind": Case(mismatched_kind, (0,), "barrier", "all_reduce on the world"),
    "wrong_group": Case(wrong_group, (3,), "all_reduce", "all_reduce on the world"),
    "missing_rank": Case(missing_rank, (3,), "all_reduce", "made no such call"),
    "different_shapes": Case(different_shapes, (1,), "all_reduce", "shape (3,) float32"),
    "swapped_order": Case(swapped_order, (2,), "broadcast", "broadcast on the world"),
    "unmatched_send": Case(unmatched_send, (0, 1), "isend", "never received"),
    "wrong_peer": Case(wrong_peer, (0,), "recv from rank 0", "rank 0 -> rank"),
    "mismatched_sizes": Case(mismatched_sizes, (0, 1), "recv", "the sizes differ"),
    "batched_ring": Case(batched_ring, (2, 3), "irecv", "the dtypes differ"),
}
TIERS = ("fake", "threaded", "gloo")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_correct_twin_passes(name: str, tier: str) -> None:
    run(CASES[name].fn, WORLD, tier, timeout=TIMEOUT, args=(False,))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_broken_program_is_reported(name: str, tier: str) -> None:
    case = CASES[name]
    with pytest.raises(CollectiveDivergence) as info:
        run(case.fn, WORLD, tier, timeout=TIMEOUT, args=(True,))
    err = info.value
    text = str(err)
    assert set(case.ranks) & set(err.ranks), text
    for rank in err.ranks:
        assert f"rank {rank} " in text, text
    assert case.text in text, text
    assert not [o for o in err.outcomes if o.status == "timeout"], text
    if err.consequence is not None:  # the run did not end normally: say how
        assert err.consequence in text, text
        assert all(o.status != "ok" or "returned" in err.consequence for o in err.outcomes)
