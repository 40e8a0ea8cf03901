"""What the frameworks print while ``sweep`` builds their groups, kept apart from its report.

The frameworks' own code prints per rank (DeepSpeed's ``Using topology: ...``, accelerator
warnings): on the in-process tiers (fake, threaded) every rank's lines landed among sweep's
progress, its table and even its ``--json -`` document on stdout. Each verification step runs
with file descriptors 1 and 2 redirected to a temporary file, at the descriptor level so that
loggers holding the original streams are caught too; the text goes with the step's result and
is shown only where that layout fails (a passing layout's chatter says nothing). gloo ranks
already write to the worker pool's log files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

#: Lines of captured output a failure report shows (the last ones: where it stopped).
SHOWN_LINES = 40


@contextlib.contextmanager
def framework_output() -> Iterator[Callable[[], str]]:
    """Redirect descriptors 1 and 2 into a temporary file for the block; the yielded function
    returns what was written once the block has ended ("" inside it)."""
    text: list[str] = []
    _flush()
    with tempfile.TemporaryFile() as sink:
        saved = (os.dup(1), os.dup(2))
        streams = (sys.stdout, sys.stderr)
        # sys.stdout / sys.stderr too: where they are not the descriptors' own streams (an
        # embedding host, pytest's capture), Python-level prints would bypass the descriptors.
        stream = open(sink.fileno(), "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            sys.stdout = sys.stderr = stream
            yield lambda: "".join(text)
        finally:
            _flush()
            sys.stdout, sys.stderr = streams
            stream.close()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            text.append(sink.read().decode("utf-8", errors="replace"))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def captured(results: Iterator[Any], batch: int = 0) -> Iterator[Any]:
    """``results`` (VerifyResults), each with ``output`` set to what was printed while it was
    computed. ``batch`` > 0: the results come in batches of that many built in one run (the
    fake tier), so a result whose step printed nothing gets its batch's output."""
    shared = ""
    for index in range(sys.maxsize):
        with framework_output() as printed:
            result = next(results, None)
        if result is None:
            return
        text = printed()
        if batch:
            if index % batch == 0:
                shared = ""
            shared += text
            text = text or shared
        yield dataclasses.replace(result, output=text) if text else result


def tail(text: str, lines: int = SHOWN_LINES) -> str:
    """The last ``lines`` lines of ``text``, saying how many were left out."""
    rows = text.rstrip("\n").splitlines()
    if len(rows) <= lines:
        return "\n".join(rows)
    return f"... {len(rows) - lines} earlier lines left out\n" + "\n".join(rows[-lines:])
