"""Threaded ranks waiting on each other: in a new group's barrier, inside a random op.

Real processes wait for peers in both places and a real run ends them when a peer fails; a
thread must do the same. Before ``meshsim.harness.threaded_waits``, a rank that reached
``new_group`` first slept out a 10 s C wait that no abort reaches (the verdict depended on
which rank got there first, and the next run in the process waited for the leftover thread),
and a random op on a DTensor that redistributes hung on meshsim's generator lock.
"""

from __future__ import annotations

import time

import pytest

import meshsim
from meshsim import CollectiveDivergence, RankFailure

pytest.importorskip("torch")

import torch
import torch.distributed as dist


def _mismatched_creation(late: int) -> None:
    if dist.get_rank() == late:
        time.sleep(0.2)  # either order must give the same verdict; this picks one
    dist.new_group([0, 1] if dist.get_rank() == 0 else [1])


def _next_run_starts_at_once() -> None:
    """A threaded run right after: no thread of the last one is left for it to wait for."""
    assert meshsim.run(lambda: dist.barrier() or True, 2, backend="threaded", timeout=5) == [
        True,
        True,
    ]


@pytest.mark.parametrize("late", [0, 1], ids=["rank0-late", "rank1-late"])
def test_a_creation_divergence_ends_every_rank_whoever_arrives_first(late: int) -> None:
    with pytest.raises(CollectiveDivergence) as info:
        meshsim.run(_mismatched_creation, 2, backend="threaded", timeout=60, args=(late,))
    assert "group creations" in str(info.value)
    _next_run_starts_at_once()


def _fail_before_creating() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails before creating the group")
    dist.new_group([0, 1])


def test_a_rank_waiting_in_the_new_group_barrier_ends_with_its_failed_peer() -> None:
    with pytest.raises(RankFailure) as info:
        meshsim.run(_fail_before_creating, 2, backend="threaded", timeout=60)
    assert "rank 1 fails before creating the group" in str(info.value)
    _next_run_starts_at_once()


def _draw_through_dtensors() -> tuple[list[list[int]], float]:
    """Random ops whose DTensor dispatch communicates: multinomial over categories sharded
    across the ranks (an all-gather first) and a sharded init (the RNG tracker's seed sync)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    probs = DTensor.from_local(torch.full((4, 2), 0.25), mesh, [Shard(1)])
    picks = torch.multinomial(probs, 1).full_tensor().tolist()
    weight = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    torch.nn.init.uniform_(weight)
    return picks, round(float(weight.full_tensor().sum()), 4)


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_random_ops_that_communicate_draw_as_on_gloo() -> None:
    threaded = meshsim.run(_draw_through_dtensors, 2, backend="threaded", timeout=60)
    gloo = meshsim.run(_draw_through_dtensors, 2, backend="gloo", timeout=120)
    assert threaded == gloo
    assert threaded[0] == threaded[1]


def test_a_harness_interrupted_while_ranks_wait_stops_them_before_returning(monkeypatch) -> None:
    """Ctrl-C (here: the divergence watch raising) in the harness's own wait: the ranks are
    stopped before the caller's world and environment come back, never left running on
    them."""
    import threading

    from meshsim.harness import live

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    def rank_zero_waits() -> None:
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never comes: rank 0 waits until the harness stops it

    monkeypatch.setattr(live.DivergenceWatch, "look", interrupted)
    with pytest.raises(KeyboardInterrupt):
        meshsim.run(rank_zero_waits, 2, backend="threaded", timeout=60)
    left = [t.name for t in threading.enumerate() if t.name.startswith("meshsim-threaded-rank")]
    assert left == []
    monkeypatch.undo()
    _next_run_starts_at_once()
