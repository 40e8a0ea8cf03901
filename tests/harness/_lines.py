"""Where a line of a test body is, as meshsim's reports name it (``tests/harness/test_x.py:12``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from meshsim.harness.sites import format_site


def line_of(fn: Callable[..., Any], text: str, *, source: bool = False) -> str:
    """The site of the first line of ``fn`` holding ``text`` (``source``: with its code)."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if text in line:
            return format_site((fn.__code__.co_filename, start + offset), source=source)
    raise AssertionError(f"{text!r} is not in {fn.__qualname__}")
