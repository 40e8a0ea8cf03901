"""The model tests describe the newest torch release; tests/model/test_torch_releases.py checks
what the reference says for an older one (the release installed, when it is older)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _newest_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "newest")


@pytest.fixture
def installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that hold the reference against the torch installed: describe that one."""
    monkeypatch.delenv("MESHSIM_TORCH_RELEASE")
