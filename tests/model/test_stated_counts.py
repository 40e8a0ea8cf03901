"""The layout counts the conventions' docstrings state ("World 8 gives 70 configs") are the
counts their ``configs`` give, so a reader is never told a stale number."""

from __future__ import annotations

import inspect
import re

import pytest

import meshsim
from meshsim.model.conventions import convention

_STATED = re.compile(r"World 8\s+gives\s+(\d+)(?:\s*\+\s*(\d+))?", re.IGNORECASE)


def _stated(framework: str) -> int | None:
    """The count ``configs``' docstring states (``32 + 19`` adds up), or None."""
    found = _STATED.search(inspect.getdoc(convention(framework).configs) or "")
    return None if found is None else sum(int(part) for part in found.groups() if part)


@pytest.mark.parametrize("framework", list(meshsim.CONVENTIONS))
def test_stated_world_8_count_is_the_count(framework: str) -> None:
    stated = _stated(framework)
    if stated is None:
        pytest.skip(f"{framework}: its configs docstring states no world-8 count")
    assert len(list(convention(framework).configs(8))) == stated
