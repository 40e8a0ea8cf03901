"""A deliberately wrong builder for negative tests: tests set ``BEHAVIOUR`` to what it should do."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshsim.checks import Observation

#: ``(world_size, config) -> Observation``; replaced by each test (via monkeypatch).
BEHAVIOUR: Callable[[int, Mapping[str, Any]], Observation] | None = None


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    if BEHAVIOUR is None:
        raise RuntimeError("tests.builders._wrong.BEHAVIOUR is not set")
    return BEHAVIOUR(world_size, config)
