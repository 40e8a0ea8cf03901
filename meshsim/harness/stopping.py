"""A stop asked for from outside a run: the CLI's Ctrl-C or SIGTERM while ranks are live.

A signal handler must not raise into whatever bytecode runs next, and a run's parent only
waits, a tick at a time, for its ranks. So the handler sets a flag here, and the tiers' wait
loops read it each tick: they stop the ranks as at a timeout (threads interrupted, worker
processes killed) and raise :class:`~meshsim.errors.RunStopped` within a tick. A framework's
own step can run for minutes; without this a Ctrl-C waited for it to end.
"""

from __future__ import annotations

import threading

from meshsim.errors import RunStopped

_REQUESTED = threading.Event()


def request() -> None:
    """Ask every run in this process to stop (safe in a signal handler: it only sets a flag)."""
    _REQUESTED.set()


def clear() -> None:
    _REQUESTED.clear()


def requested() -> bool:
    return _REQUESTED.is_set()


def stopped(fn: object, world_size: int) -> RunStopped:
    """The error a run raises once its ranks were stopped on request."""
    name = getattr(fn, "__name__", repr(fn))
    return RunStopped(
        f"meshsim.run({name}, world_size={world_size}) stopped on request (Ctrl-C or "
        "SIGTERM): its ranks were stopped before they finished"
    )
