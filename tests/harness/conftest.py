"""Leak checks shared by the harness tests: processes, threads and temp dirs after each test."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from meshsim.harness import rendezvous
from meshsim.harness.pool import pool_pids


def child_pids() -> set[int]:
    """Live children of this process (zombies excluded), read from /proc."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        except OSError:
            continue
    return {p for p in pids if process_alive(p)}


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def job_dirs() -> list[str]:
    """Per-job temp dirs of this process that still exist (the pool's own dir may stay)."""
    return [d for d in rendezvous.leftover_dirs() if "-pool-" not in os.path.basename(d)]


def meshsim_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("meshsim-")]


def assert_no_leaks(before_threads: set[int]) -> None:
    """Only pool workers may remain as children; no job dir; no new harness thread."""
    stray = child_pids() - set(pool_pids())
    assert not stray, f"child processes left behind that are not pool workers: {stray}"
    assert not job_dirs(), f"job temp dirs left behind: {job_dirs()}"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before_threads]
        if not extra:
            break
        time.sleep(0.05)
    extra = [t.name for t in threading.enumerate() if t.ident not in before_threads]
    assert not extra, f"threads left behind: {extra}"


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every harness test: no stray child process, job dir or thread."""
    before = {t.ident for t in threading.enumerate()}
    yield
    if request.node.get_closest_marker("allow_thread_leak") is None:
        assert_no_leaks(before)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_thread_leak: the test deliberately leaves a stuck thread behind"
    )
