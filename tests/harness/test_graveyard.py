"""The graveyard frees buried groups off the calling thread, and only once nothing else holds
them. Plain objects stand in for process groups here (what the graveyard relies on is their
reference count and that their destructor may block); the gloo tier's tests run it on real
groups (tests/harness/test_gloo_kept_world.py)."""

from __future__ import annotations

import threading

import pytest

from meshsim.harness.graveyard import Graveyard

#: Generous bound for a freeing thread to run; only a broken graveyard waits this long.
PATIENCE_S = 60.0


class Group:
    """Records which thread destroys it; its destructor blocks until ``release`` is set, as
    gloo's waits for its event loop."""

    def __init__(self, freed: list[int], release: threading.Event | None = None) -> None:
        self.freed = freed
        self.release = release

    def __del__(self) -> None:
        if self.release is not None:
            self.release.wait(PATIENCE_S)
        self.freed.append(threading.get_ident())


def test_a_group_nothing_else_holds_is_freed_in_another_thread() -> None:
    freed: list[int] = []
    graveyard = Graveyard()
    graveyard.bury(Group(freed))
    assert graveyard.free() == 1
    assert graveyard.wait()
    assert len(freed) == 1 and freed[0] != threading.get_ident()
    assert len(graveyard) == 0


def test_free_returns_while_the_groups_are_still_being_destroyed() -> None:
    """A destructor that cannot finish before ``free`` returns: the caller goes on."""
    freed: list[int] = []
    release = threading.Event()
    graveyard = Graveyard()
    for _ in range(3):
        graveyard.bury(Group(freed, release))
    assert graveyard.free() == 3
    assert freed == []  # every destructor is still blocked, and we got here
    release.set()
    assert graveyard.wait()
    assert len(freed) == 3
    assert len(set(freed)) == 3  # each in its own thread: their waits overlap
    assert threading.get_ident() not in freed


def test_a_group_still_held_elsewhere_stays_buried_until_released() -> None:
    freed: list[int] = []
    graveyard = Graveyard()
    held = Group(freed)  # what a cycle or a framework's global would hold
    graveyard.bury(held)
    graveyard.bury(Group(freed))
    assert graveyard.free() == 1  # only the one nothing else holds
    assert graveyard.wait()
    assert len(freed) == 1 and len(graveyard) == 1
    del held
    assert freed[1:] == []  # the graveyard still holds it: dropping ours freed nothing
    assert graveyard.free() == 1
    assert graveyard.wait()
    assert len(freed) == 2 and threading.get_ident() not in freed
    assert len(graveyard) == 0


def test_wait_reports_a_destructor_that_does_not_finish() -> None:
    freed: list[int] = []
    release = threading.Event()
    graveyard = Graveyard()
    graveyard.bury(Group(freed, release))
    graveyard.free()
    assert not graveyard.wait(timeout=0.01)  # blocked until release: cannot have finished
    release.set()
    assert graveyard.wait()
    assert len(freed) == 1


def test_many_groups_share_a_bounded_number_of_threads() -> None:
    from meshsim.harness.graveyard import THREADS

    freed: list[int] = []
    release = threading.Event()
    graveyard = Graveyard()
    for _ in range(3 * THREADS + 1):
        graveyard.bury(Group(freed, release))
    assert graveyard.free() == 3 * THREADS + 1
    release.set()
    assert graveyard.wait()
    assert len(freed) == 3 * THREADS + 1
    assert len(set(freed)) == THREADS and threading.get_ident() not in freed


def test_groups_stay_buried_when_no_thread_can_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pids limit reached: nothing is freed, nothing waits, and the next call retries."""
    from meshsim.harness import graveyard as module

    def refuse(*args: object) -> None:
        raise RuntimeError("can't start new thread")

    freed: list[int] = []
    graveyard = Graveyard()
    graveyard.bury(Group(freed))
    monkeypatch.setattr(module._thread, "start_new_thread", refuse)
    assert graveyard.free() == 0
    assert graveyard.wait(timeout=0.01)  # no lock left held
    assert freed == [] and len(graveyard) == 1
    monkeypatch.undo()
    assert graveyard.free() == 1
    assert graveyard.wait()
    assert len(freed) == 1 and freed[0] != threading.get_ident()
