"""Aborting a threaded world while its ranks start collectives.

A rank that fails (or the harness stopping a run) wakes every rank waiting in a threaded
collective. torch's ``ProcessLocalGroup.exception_handle`` walks the table of live collectives
without its lock, so a rank starting a collective on another group at that moment made the
abort raise "dictionary changed size during iteration" (CI, torch 2.15, once:
``test_ep_lockstep``'s divergence test) and could leave waiters asleep. Here that moment is
made to happen every time: the first waiter woken lets another rank start a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from meshsim import torch_private

pytest.importorskip("torch")


class _Group:
    """What ``ProcessLocalGroup._start_coll`` reads of a process group."""

    def __init__(self, name: str) -> None:
        self.pg_name = name

    def size(self) -> int:
        return 2


class _StartsACollectiveWhenWoken(threading.Condition):
    """A waiters' condition whose first wake-up coincides with another rank starting a
    collective on a new group (``_start_coll`` runs to completion in a second thread), once
    ``armed``."""

    def __init__(self, plg: type) -> None:
        super().__init__()
        self._plg = plg
        self.armed = False

    def __enter__(self) -> bool:
        if self.armed:
            self.armed = False
            other = threading.Thread(target=self._plg._start_coll, args=(None, _Group("late")))
            other.start()
            other.join(timeout=60)
        return super().__enter__()


@pytest.fixture
def plg() -> Iterator[type]:
    plg = torch_private.threaded_pg().ProcessLocalGroup
    plg.reset()
    yield plg
    plg.reset()


def _waiting_ranks(plg: type) -> tuple[list[threading.Thread], list[BaseException]]:
    """Rank 0 waiting for its peer on group ``a``; rank 1 waiting for rank 0 on group ``b``
    (rank 0 has joined ``b`` but not finished it): both asleep in real ``Collective``s."""
    module = torch_private.threaded_pg()
    a = plg._start_coll(None, _Group("a"))
    b = plg._start_coll(None, _Group("b"))
    a._start_cond = _StartsACollectiveWhenWoken(plg)
    b._count = 1  # rank 0 joined b and is busy elsewhere
    assert isinstance(a, module.Collective)
    raised: list[BaseException] = []

    def rank(join: Callable[[], object]) -> None:
        try:
            join()
        except BaseException as exc:  # SystemExit: torch's way out of an aborted collective
            raised.append(exc)

    threads = [
        threading.Thread(target=rank, args=(lambda: a.join(0, [None]),)),
        threading.Thread(target=rank, args=(lambda: b.join(1, [None]),)),
    ]
    for t in threads:
        t.start()
    for name, waiters in (("a", a._start_cond), ("b", b._done_cond)):
        assert _wait_until_asleep(waiters), f"a rank never went to sleep on group {name}"
    a._start_cond.armed = True
    return threads, raised


def _wait_until_asleep(cond: threading.Condition) -> bool:
    """True once a thread waits on ``cond`` (a private of threading, read-only)."""
    for _ in range(6000):
        with cond:
            if cond._waiters:  # type: ignore[attr-defined]
                return True
        threading.Event().wait(0.01)
    return False


def test_torchs_own_abort_breaks_when_a_rank_starts_a_collective_meanwhile(plg) -> None:
    """The upstream race, pinned: when this fails, torch locked its walk and
    ``abort_threaded_world`` can go back to ``exception_handle``."""
    threads, _ = _waiting_ranks(plg)
    try:
        with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
            plg.exception_handle(RuntimeError("a rank failed"))
    finally:
        torch_private.abort_threaded_world()
        for t in threads:
            t.join(timeout=60)


def test_abort_wakes_every_waiting_rank_while_another_starts_a_collective(plg) -> None:
    threads, raised = _waiting_ranks(plg)
    torch_private.abort_threaded_world()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a waiting rank was never woken"
    assert sorted(type(e).__name__ for e in raised) == ["SystemExit", "SystemExit"]
    assert "late" in plg._cur_coll_on_pgs  # the other rank did start its collective
    late = plg._cur_coll_on_pgs["late"]
    with pytest.raises(SystemExit):  # and it cannot block: the world is aborted
        late.join(0, [None])
