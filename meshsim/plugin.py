"""pytest11 entry point: meshsim's options, markers and fixtures.

Imports nothing heavy: torch loads only when a test actually runs on ranks.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshsim", "meshsim: run test bodies on N ranks")
    group.addoption(
        "--meshsim-backend",
        default=None,
        help="override the backend of every @pytest.mark.meshsim test (fake, threaded, gloo, nccl)",
    )
    group.addoption(
        "--meshsim-timeout",
        default=None,
        type=float,
        help="override the per-test timeout in seconds of @pytest.mark.meshsim tests",
    )
    group.addoption(
        "--meshsim-max-world-size",
        default=None,
        type=int,
        help="skip @pytest.mark.meshsim items whose world size exceeds this",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "meshsim(world_size=4, backend='threaded', timeout=60): run the test body on every rank",
    )
