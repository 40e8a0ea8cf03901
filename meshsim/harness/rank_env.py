"""Each in-process rank's environment variables and working directory, as a process's would be.

A gloo or nccl worker is a process: before each job it sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (what torchrun gives its workers), and afterwards it
restores the caller's environment and working directory. The fake and threaded tiers run the
ranks inside the caller's process, where ``os.environ`` and the working directory are shared.
A trainer that reads ``int(os.environ["LOCAL_RANK"])`` would fail there, or read the caller's
value. One rank's ``os.environ["X"] = ...`` would reach every other rank.

While an in-process run lasts, ``os.environ`` is a :class:`RankEnviron`. A rank's thread reads
and writes its own copy: the caller's environment plus its rank variables. Any other thread
sees the process's environment. ``os.chdir`` on the fake tier is undone after each rank (ranks
run in turn there, so each starts in the caller's directory). On the threaded tier it is
refused with a line saying why: threads share one working directory, and relative paths opened
by other ranks would move with it.

torch's own writes (``torch.compile``'s inductor sets ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``
for the C++ it compiles, which reads it back with ``getenv``) go to the process's environment
as well as the rank's copy: they describe the one process every rank shares, and C code sees
no other environment. Not covered: C code reading a variable a rank's own code set, and
subprocesses started with ``env=None``; both see the process's environment.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from meshsim.errors import UsageError

_views = threading.local()


def rank_variables(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun sets for a worker of a one-node job, as the gloo workers set it."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


class RankEnviron(MutableMapping[str, str]):
    """``os.environ`` during an in-process run: the calling rank's own copy, or the process's
    environment for any thread that is not a rank."""

    def __init__(self, process: MutableMapping[str, str]) -> None:
        self.process = process

    def _target(self) -> MutableMapping[str, str]:
        own = getattr(_views, "env", None)
        return self.process if own is None else own

    def __getitem__(self, key: str) -> str:
        return self._target()[key]

    def __setitem__(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"str expected, not {type(key if not isinstance(key, str) else value).__name__}"
            )
        own = self._target()
        own[key] = value
        if own is not self.process and _written_by_torch():
            self.process[key] = value  # putenv: torch's C++ reads it with getenv

    def __delitem__(self, key: str) -> None:
        del self._target()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._target()))

    def __len__(self) -> int:
        return len(self._target())

    def copy(self) -> dict[str, str]:
        return dict(self._target())

    def __repr__(self) -> str:
        return f"RankEnviron({dict(self._target())!r})"


#: Modules whose frames stand between a write and its author (``os.environ.setdefault`` and
#: ``update`` are ``MutableMapping`` methods).
_PASS_THROUGH = ("_collections_abc", "os", __name__)


def _written_by_torch() -> bool:
    """Whether the code writing to ``os.environ`` now is torch's own."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _PASS_THROUGH:
        frame = frame.f_back
    name = "" if frame is None else str(frame.f_globals.get("__name__", ""))
    return name == "torch" or name.startswith("torch.")


@contextmanager
def in_process_environments(tier: str) -> Iterator[None]:
    """While an in-process run lasts: ``os.environ`` per rank, ``os.chdir`` guarded."""
    process_environ = os.environ
    process_chdir = os.chdir

    def chdir(path: Any) -> None:
        rank = getattr(_views, "rank", None)
        if rank is not None and tier == "threaded":
            raise UsageError(
                f"os.chdir({path!r}) on rank {rank}: threaded ranks are threads of one process "
                "and share one working directory, so every rank would move; open files by "
                "absolute path, or run on backend='gloo' (a process per rank)"
            )
        process_chdir(path)

    # The mapping is swapped, not cleared (B003): os.getenv reads this module global too.
    os.environ = RankEnviron(process_environ)  # type: ignore[assignment]  # noqa: B003
    os.chdir = chdir
    try:
        yield
    finally:
        os.environ = process_environ  # noqa: B003
        os.chdir = process_chdir


@contextmanager
def rank_environment(rank: int, world_size: int) -> Iterator[None]:
    """In a rank's thread: its own copy of the environment; on leaving, the caller's
    working directory is back (the fake tier's ranks run in turn in one thread)."""
    environ = os.environ
    process = environ.process if isinstance(environ, RankEnviron) else environ
    _views.env = {**process, **rank_variables(rank, world_size)}
    _views.rank = rank
    cwd = os.getcwd()
    try:
        yield
    finally:
        _views.env = None
        _views.rank = None
        if os.getcwd() != cwd:
            os.chdir(cwd)
