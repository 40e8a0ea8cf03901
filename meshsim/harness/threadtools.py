"""Stacks of live threads and the one way Python offers to stop them (an async exception)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
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
    the ``with`` body or in ``__exit__``: callers catch it around the whole block. One
    watchdog serves any number of consecutive blocks of its thread (the fake tier's ranks,
    1,024 of them at a time: one watching thread, not one each); ``close`` ends it.
    """

    def __init__(self, seconds: float | None, ident: int | None = None) -> None:
        self.seconds = seconds
        self.ident = ident if ident is not None else threading.get_ident()
        self.fired = False
        self.stack: str | None = None
        self._deadline: float | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._deadline = None
                self.stack = thread_stack(self.ident)
                self.fired = True
                async_raise(self.ident)

    def __enter__(self) -> Watchdog:
        with self._wake:
            self.fired, self.stack = False, None
            if self.seconds is not None:
                self._deadline = time.monotonic() + self.seconds
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="meshsim-watchdog", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._deadline = None
        if self.fired and self.ident == threading.get_ident():
            async_raise(self.ident, None)  # drop an interrupt that has not landed yet

    def close(self) -> None:
        """Stop the watching thread (after the last block)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
