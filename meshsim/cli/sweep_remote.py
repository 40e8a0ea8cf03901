"""Inside a sweep worker process: verify the chunks of layouts the sweep sends, one message
per layout as it is done.

The sweep itself only waits for these messages, so a signal finds it idle and it can stop at
once: it kills the workers (``meshsim.cli.sweep_workers``) instead of waiting for a layout,
and reports what arrived. Nothing here runs in the sweep's own process but the dataclasses.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from meshsim.cli.captured import captured
from meshsim.cli.placement import Placed, Question, place
from meshsim.errors import LayoutError
from meshsim.model.sweep import LayoutCase

#: Seconds between checks that the sweep is still alive (a worker outlives no sweep).
ORPHAN_POLL_S = 0.5


#: The tier that builds no live rank: the reference's groups, findings and placement only.
REFERENCE = "reference"
#: Reference answers a worker holds before sending them, at most, and for at most how long.
HOLD = 32
HOLD_S = 0.1


@dataclass(frozen=True)
class Chunk:
    """Layouts one worker verifies on one tier. ``first``: the sweep's first step, which also
    answers what only depends on the reference (its findings, its node placement, its group
    fingerprint). ``ranks``: on the fake tier, only these ranks build (None: every rank)."""

    cases: list[LayoutCase]
    tier: str
    timeout: float
    real: bool = False
    first: bool = True
    question: Question | None = None
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Examined:
    """One layout's answer from a worker: its result (None: left out by ``--within-node``,
    never built), and on the first step its findings, placement and group fingerprint."""

    result: Any
    findings: list[dict[str, str]] | None = None
    placed: Placed | None = None
    fingerprint: str | None = None
    #: Process groups the framework makes for it (every kind's groups, summed): what a live
    #: build costs grows with it. 0 when the reference refuses the layout.
    groups: int = 0


@dataclass(frozen=True)
class ReferenceResult:
    """A layout examined by the reference alone (``sweep --backend reference``): its groups,
    roles, findings and placement are known; nothing was built, so nothing can fail here."""

    framework: str
    world_size: int
    config: dict[str, Any]
    seconds: float
    kinds_checked: tuple[str, ...]
    rejected: str | None = None
    backend: str = REFERENCE
    real: bool = False
    passed: bool = True
    diff: None = None
    error: None = None
    observations: None = None


def examine(chunk: Chunk) -> Iterator[tuple[int, Examined]]:
    """(index in the chunk, answer) as each layout is done. The reference facts of a layout
    are worked out when the verifier takes it, so the first answers come at once even for a
    long chunk; a layout ``--within-node`` leaves out is answered without being built."""
    if chunk.tier == REFERENCE:
        yield from _examine_reference(chunk)
        return
    from meshsim.verify import FAKE_BATCH, verify_many

    facts: dict[int, tuple[list[dict[str, str]] | None, Placed | None]] = {}
    order: list[int] = []  # chunk indices of the layouts handed to the verifier, in turn
    left_out: list[tuple[int, Examined]] = []

    def kept() -> Iterator[LayoutCase]:
        for index, case in enumerate(chunk.cases):
            findings, placed = (
                _reference_facts(case, chunk.question) if chunk.first else (None, None)
            )
            if placed is not None and not placed.kept:
                left_out.append((index, Examined(None, None, placed)))
                continue
            facts[index] = (findings, placed)
            order.append(index)
            yield case

    found = verify_many(
        kept(), chunk.tier, timeout=chunk.timeout, real=chunk.real, ranks=chunk.ranks
    )
    batch = FAKE_BATCH if chunk.tier == "fake" else 0
    for position, result in enumerate(captured(found, batch)):
        yield from _drain(left_out)
        index = order[position]
        yield index, Examined(result, *facts.pop(index))
    yield from _drain(left_out)


def _examine_reference(chunk: Chunk) -> Iterator[tuple[int, Examined]]:
    """The reference step: each layout's findings, placement and group fingerprint, without a
    live rank (torch is never imported here)."""
    from meshsim.model.fingerprint import group_fingerprint, process_group_kinds

    for index, case in enumerate(chunk.cases):
        start = time.perf_counter()
        try:
            expected = case.expect()
        except LayoutError as error:
            placed = None if chunk.question is None else place(None, chunk.question)
            result = ReferenceResult(
                case.framework, case.world_size, dict(case.config), 0.0, (), str(error)
            )
            yield index, Examined(result, [], placed)
            continue
        findings, placed = _reference_facts(case, chunk.question, expected)
        built = process_group_kinds(expected)
        fingerprint = group_fingerprint(expected, built)
        groups = sum(len(kind.groups()) for kind in built)
        derived = expected.derived_kinds()
        kinds = tuple(k for k in expected.kinds() if k not in derived)
        seconds = time.perf_counter() - start
        result = ReferenceResult(case.framework, case.world_size, dict(case.config), seconds, kinds)
        yield index, Examined(result, findings, placed, fingerprint, groups)


def _drain(answers: list[tuple[int, Examined]]) -> Iterator[tuple[int, Examined]]:
    while answers:
        yield answers.pop(0)


def _reference_facts(
    case: LayoutCase, question: Question | None, expected: Any = None
) -> tuple[list[dict[str, str]], Placed | None]:
    """The invariants the reference layout breaks, and its node placement when asked. A
    layout the reference refuses (another torch release's) has neither finding nor group."""
    from meshsim.cli.commands import findings_json

    try:
        expected = expected if expected is not None else case.expect()
    except LayoutError:
        return [], None if question is None else place(None, question)
    placed = None if question is None else place(expected, question)
    return findings_json(expected), placed


def main(fd: int) -> None:
    """Entry point of a worker: answer ``("chunk", id, Chunk)`` messages until ``("exit",)``
    or the end of the connection.

    Ctrl-C reaches the sweep, not us (its own session), and the sweep decides; a worker whose
    sweep died exits by itself. An error outside any layout's verification (a bug) goes back
    as its traceback, and the sweep raises it.
    """
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    conn = Connection(fd)
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the sweep closed its end, or is gone
            break
        if message[0] == "exit":
            break
        _, chunk_id, chunk = message
        held: list[tuple[int, Examined]] = []
        since = time.monotonic()
        try:
            for index, answer in examine(chunk):
                held.append((index, answer))
                # A reference answer takes about a millisecond: send them by the few (the
                # sweep then reads a message per batch, not per layout), yet within
                # HOLD_S of the first, so progress lines stay live.
                if (
                    chunk.tier == REFERENCE
                    and len(held) < HOLD
                    and time.monotonic() - since < HOLD_S
                ):
                    continue
                if not _send(conn, "cases", chunk_id, held):
                    return  # the sweep is gone: nobody to answer
                held, since = [], time.monotonic()
        except Exception:
            _send(conn, "error", chunk_id, traceback.format_exc())
            break
        if held and not _send(conn, "cases", chunk_id, held):
            return
        if not _send(conn, "done", chunk_id):
            return
    conn.close()
    sys.stdout.flush()


def _send(conn: Any, *message: Any) -> bool:
    """Send ``message``; False when the sweep's end of the connection is gone."""
    try:
        conn.send_bytes(pickle.dumps(message))
    except OSError:
        return False
    return True


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent:
            os._exit(70)
