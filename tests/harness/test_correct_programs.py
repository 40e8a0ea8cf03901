"""Correct programs (and plain failures) that the divergence judge must not call divergences.

The harness judges every rank's recording however a run ends; these are the schedules a
review found where a naive judge would blame a correct program: a failed rank that leaves
its peers waiting in different calls, async collectives issued in different orders, a rank
that issues collectives from two threads, and calls made by a rank's handlers after the
harness stopped it.
"""

from __future__ import annotations

import pytest

from meshsim.errors import CollectiveDivergence, RankFailure, RankTimeout
from meshsim.harness import run

#: A hang guard far above what these programs need.
TIMEOUT = 300.0


def raise_while_peers_wait_in_different_calls() -> None:
    """Rank 0 raises; rank 1 waits in an all_reduce on (0, 1) before the world one that rank
    2 waits in. Both waits are rank 0's fault: a RankFailure, not a divergence."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    if rank == 0:
        raise ValueError("rank 0 gives up")
    if rank == 1:
        dist.all_reduce(torch.ones(1), group=group)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("tier", ["threaded", "gloo"])
def test_a_failed_rank_is_a_failure_even_when_its_peers_wait_apart(tier: str) -> None:
    with pytest.raises(RankFailure) as info:
        run(raise_while_peers_wait_in_different_calls, 3, tier, timeout=TIMEOUT)
    assert not isinstance(info.value, CollectiveDivergence), info.value
    assert "rank 0: ValueError: rank 0 gives up" in str(info.value)


def async_collectives_in_crossed_order() -> float:
    """Each rank starts one collective asynchronously and runs the other first: fine on a
    real backend, since the async one does not block."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    a, b = torch.ones(1), torch.ones(1)
    if dist.get_rank() == 0:
        work = dist.all_reduce(a, async_op=True)
        dist.all_reduce(b, group=group)
    else:
        work = dist.all_reduce(b, group=group, async_op=True)
        dist.all_reduce(a)
    work.wait()
    return float(a[0] + b[0])


def test_async_collectives_in_crossed_order_pass_on_gloo() -> None:
    assert run(async_collectives_in_crossed_order, 2, "gloo", timeout=TIMEOUT) == [4.0, 4.0]


def collectives_from_two_threads() -> float:
    """Rank 0 runs its group all_reduce in a second thread, a second after its main thread
    entered the world one; rank 1 runs them in order. Correct on gloo."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    x, y = torch.ones(1), torch.ones(1)
    if dist.get_rank() == 0:

        def side() -> None:
            time.sleep(1.0)
            dist.all_reduce(x, group=group)

        thread = threading.Thread(target=side)
        thread.start()
        dist.all_reduce(y)
        thread.join()
    else:
        dist.all_reduce(x, group=group)
        dist.all_reduce(y)
    return float(x[0] + y[0])


def test_collectives_from_two_threads_of_one_rank_pass_on_gloo() -> None:
    assert run(collectives_from_two_threads, 2, "gloo", timeout=TIMEOUT) == [4.0, 4.0]


def slow_rank_with_cleanup() -> None:
    """Rank 0 computes past the deadline; rank 1 waits for its message, rank 2 in a world
    all_reduce. When the harness stops the run, rank 1's ``finally`` enters a barrier: that
    call is the harness's doing, and must not turn the timeout into a divergence."""
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        if rank == 0:
            while True:
                time.sleep(0.01)
        elif rank == 1:
            dist.recv(torch.zeros(1), 0)
        else:
            dist.all_reduce(torch.ones(1))
    finally:
        if rank == 1:
            dist.barrier()


def test_calls_made_while_the_harness_stops_a_run_are_not_judged() -> None:
    # 10 s: long enough for ranks 1 and 2 to reach their calls on a loaded machine; rank 0
    # never returns, so the deadline is what ends the run.
    with pytest.raises(RankTimeout) as info:
        run(slow_rank_with_cleanup, 3, "gloo", timeout=10)
    assert info.value.collectives[0] is None
    assert "recv from rank 0" in (info.value.collectives[1] or "")
