"""Every wait of a threaded rank ends when the world is aborted, and none holds the RNG lock.

torch's threaded backend has two waits meshsim must reach:

* a collective (``Collective.join``) leaves on the abort, but runs with whatever locks the
  rank holds: inside a random op on a DTensor (a redistribution, the RNG tracker's seed
  broadcast) that is meshsim's generator lock (``meshsim.harness.rng``), and the peers it
  waits for wait for that lock. Each join now steps out of the rank's random call first.
* a new group's store barrier (``_create_threaded_pg``) waits in C for at least 10 s slices
  that neither the abort nor ``HarnessInterrupt`` reaches: a rank that got there first
  outlived the run that a peer's failure or divergence ended, and the next threaded run in
  the process waited for it or refused to start. The barrier is the same add-and-wait on the
  same keys, waiting in short slices between which it looks at the abort.
"""

from __future__ import annotations

import functools
import sys
import time
from datetime import timedelta
from typing import Any

from meshsim import torch_private
from meshsim.harness import rng

#: Seconds a rank waits in the store between looks at the abort.
SLICE_S = 0.05


def install(module: Any) -> None:
    """Patch torch's threaded backend ``module`` (``multi_threaded_pg``), once."""
    if getattr(module, "__meshsim_waits__", False):
        return
    collective = module.Collective
    original_join = collective.join

    @functools.wraps(original_join)
    def join(self: Any, rank: int, data: Any) -> Any:
        with rng.stepped_out():
            return original_join(self, rank, data)

    collective.join = join
    module._store_based_barrier = _barrier
    module.__meshsim_waits__ = True


def _barrier(
    rank: int,
    store: Any,
    group_name: str,
    rendezvous_count: int,
    timeout: timedelta,
    logging_interval: timedelta | None = None,
) -> None:
    """c10d's ``_store_based_barrier`` (the same keys and counts), abortable."""
    del logging_interval
    from torch.distributed import DistStoreError

    key = f"{torch_private.store_barrier_prefix()}:{group_name}"
    last = f"{key}:last_worker"
    store.add(key, 1)
    if store.add(key, 0) == rendezvous_count:
        store.set(last, "1")
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store.wait([last], timedelta(seconds=SLICE_S))
            return
        except RuntimeError:
            if torch_private.threaded_world_aborted():
                sys.exit("Test termination event occurs.")  # as torch's collectives
            if time.monotonic() > deadline:
                raise DistStoreError(
                    f"Timed out initializing process group in store based barrier on rank "
                    f"{rank}, for key: {key} (world_size={rendezvous_count}, "
                    f"num_workers_joined={store.add(key, 0)}, timeout={timeout})"
                ) from None
