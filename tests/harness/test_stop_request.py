"""A stop asked for from outside a run (the CLI's Ctrl-C or SIGTERM during a framework's own
step, which can run for minutes) stops the ranks and raises ``RunStopped``, on the threaded and
the gloo tier. The bodies below never end: without the request each run would end only at its
600 s timeout, as a ``RankTimeout``, so the verdict here is the exception's type, not a time."""

from __future__ import annotations

import threading
import time

import pytest

import meshsim
from meshsim.errors import RunStopped
from meshsim.harness import stopping


def _forever() -> None:
    while True:
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_a_stop_request_ends_a_live_run_with_run_stopped(backend: str) -> None:
    started = threading.Event()

    def body() -> None:
        started.set()  # threaded ranks set the test's event; gloo ranks set their own copy
        _forever()

    def request_once_running() -> None:
        if backend == "threaded":
            started.wait(30)
        stopping.request()  # gloo: at once; the parent reads it on its first tick either way

    threading.Thread(target=request_once_running, daemon=True).start()
    try:
        with pytest.raises(RunStopped, match=r"stopped on request"):
            meshsim.run(body, world_size=2, backend=backend, timeout=600)
    finally:
        stopping.clear()
    # The tier is usable again at once: the next run is not stopped by the old request.
    assert meshsim.run(lambda: 1, world_size=2, backend=backend) == [1, 1]


def test_a_stopped_gloo_run_starts_no_replacement_workers() -> None:
    """After a stop request the process is about to end: the killed ranks' workers are not
    replaced (eight fresh workers booting as the user's Ctrl-C lands kept the interpreter's
    exit waiting for them, 5 s, since a booting worker reads no "exit")."""
    from meshsim.harness.pool import get_pool

    assert meshsim.run(lambda: 1, world_size=2, backend="gloo") == [1, 1]  # 2 warm workers
    pool = get_pool()
    started = pool.count
    stopping.request()
    try:
        with pytest.raises(RunStopped):
            meshsim.run(_forever, world_size=2, backend="gloo", timeout=600)
        assert pool.count == started  # none started for the run, none to replace its ranks
    finally:
        stopping.clear()
