"""Destroyed gloo groups, freed in parallel threads off a pool worker's critical path.

Freeing a gloo process group is slow and mostly waiting: each of its TCP pairs, as it closes,
waits for its device's event loop to tick (gloo's ``transport/tcp/loop.cc`` polls with a
10 ms timeout), then the loop thread is joined. Six world-8 groups take ~330 ms to free one
after another. torch releases the GIL while it destroys a group, so the same six freed in six
threads take ~35-85 ms, and the rank's main thread runs meanwhile.

Left alone, a destroyed group is freed wherever its last reference goes, and frameworks (and a
sliced ``DeviceMesh``) hold groups in reference cycles: the cyclic collector then frees them
in the main thread, in the middle of a later job, while that rank's peers wait for it inside a
collective. That gave warm world-8 gloo tests their 150-520 ms outliers. Buried here, a group
outlives its cycles (a collection frees the cycle, not the group) and is freed by
:meth:`Graveyard.free` between jobs, once nothing but the graveyard holds it.
"""

from __future__ import annotations

import _thread
import sys
from typing import Any

#: How long :meth:`Graveyard.wait` waits for the groups being freed.
FREE_TIMEOUT_S = 30.0
#: Threads one :meth:`Graveyard.free` starts at most; more groups share them, in turn.
THREADS = 16


def _refcounts(items: list[Any]) -> list[int]:
    return [sys.getrefcount(item) for item in items]


#: What ``_refcounts`` reports for an object nothing but its list holds, on this Python.
_ALONE = _refcounts([object()])[0]


class Graveyard:
    """Destroyed process groups a worker keeps until it can free them in parallel."""

    def __init__(self) -> None:
        self._buried: list[Any] = []
        self._freeing: list[Any] = []  # one held lock per group being freed

    def bury(self, group: Any) -> None:
        """Keep ``group`` (already destroyed) until :meth:`free` can drop its last reference."""
        self._buried.append(group)

    def free(self) -> int:
        """Start freeing the buried groups nothing else holds, in up to ``THREADS`` threads
        at once; the others (a cycle not yet collected, a framework's global) stay buried.
        Returns how many it started on. The threads are ``_thread``'s, invisible to
        ``threading.enumerate``: the check for threads a rank's body left running must not
        see them."""
        self._freeing = [lock for lock in self._freeing if lock.locked()]
        buried, self._buried = self._buried, []
        boxes: list[list[Any]] = []
        for index, count in enumerate(_refcounts(buried)):
            if count <= _ALONE:
                boxes.append([buried[index]])
            else:
                self._buried.append(buried[index])
        del buried  # each box now holds its group's last reference, for a thread to drop
        started = 0
        for chunk in (boxes[i::THREADS] for i in range(min(len(boxes), THREADS))):
            done = _thread.allocate_lock()
            done.acquire()
            try:
                _thread.start_new_thread(_drop, (chunk, done))
            except RuntimeError:  # no thread to be had (a pids limit): the next call retries
                done.release()
                for box in chunk:
                    self._buried.extend(box)
                continue
            self._freeing.append(done)
            started += len(chunk)
        return started

    def wait(self, timeout: float = FREE_TIMEOUT_S) -> bool:
        """Wait until every group :meth:`free` started on is freed; False on timeout."""
        for done in self._freeing:
            if not done.acquire(timeout=timeout):
                return False
            done.release()
        self._freeing = []
        return True

    def __len__(self) -> int:
        """Groups still buried (not yet handed to a freeing thread)."""
        return len(self._buried)


def _drop(boxes: list[list[Any]], done: Any) -> None:
    """Drop the one reference to each group: torch destroys it here, without the GIL."""
    try:
        for box in boxes:
            box.clear()
    finally:
        done.release()
