"""Stacks of live threads and the one way Python offers to stop them (an async exception)."""

from __future__ import annotations

import ctypes
import sys
import threading
import traceback


class HarnessInterrupt(BaseException):
    """Raised inside a rank thread by the harness to stop it at a deadline.

    A ``BaseException`` so that ``except Exception`` in the body does not swallow it.
    """


def thread_stack(ident: int | None) -> str:
    """The current Python stack of thread ``ident`` (most recent call last)."""
    from meshsim.harness.outcome import trim_stack_text

    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "(thread has no Python frame: finished or not started)\n"
    return trim_stack_text("".join(traceback.format_stack(frame)))


def async_raise(ident: int | None, exc_type: type[BaseException] | None = HarnessInterrupt) -> bool:
    """Ask thread ``ident`` to raise ``exc_type`` at its next Python bytecode (None: cancel).

    It cannot interrupt a thread blocked inside C code (a lock acquire without timeout, a
    sleep, a C++ collective): the exception fires only when that call returns.
    """
    if ident is None:
        return False
    arg = ctypes.py_object(exc_type) if exc_type is not None else None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), arg)
    if done > 1:  # pragma: no cover - would mean a corrupted thread table
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return done == 1


class Watchdog:
    """Interrupts one thread if it is still inside a ``with`` block at a deadline.

    Before interrupting it snapshots that thread's stack, so the timeout report shows where
    the thread was, not where the interrupt landed. The ``HarnessInterrupt`` may surface in
    the ``with`` body or in ``__exit__``: callers catch it around the whole block.
    """

    def __init__(self, seconds: float, ident: int | None = None) -> None:
        self.seconds = seconds
        self.ident = ident if ident is not None else threading.get_ident()
        self.fired = False
        self.stack: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="meshsim-watchdog", daemon=True)

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        with self._lock:
            if self._done.is_set():
                return
            self.stack = thread_stack(self.ident)
            self.fired = True
            async_raise(self.ident)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done.set()
        self._thread.join()
        if self.fired and self.ident == threading.get_ident():
            async_raise(self.ident, None)  # drop an interrupt that has not landed yet
