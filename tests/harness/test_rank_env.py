"""Each rank's environment and working directory behave as a process's would, on every tier.

Trainers read ``int(os.environ["LOCAL_RANK"])``. A gloo worker has torchrun's variables. Fake and
threaded ranks run in the caller's process, and had none of them; one rank's writes reached the
others and the caller.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import meshsim

TIERS = ["fake", "threaded", "gloo"]


def _variables_and_writes() -> tuple[str, ...]:
    import time

    os.environ["MESHSIM_TEST_MINE"] = os.environ["RANK"]
    time.sleep(0.05)  # the other threaded ranks write meanwhile
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MESHSIM_TEST_MINE")
    return (*(os.environ[n] for n in names), str(os.getenv("MESHSIM_TEST_MINE")))


@pytest.mark.parametrize("backend", TIERS)
def test_rank_variables_and_a_ranks_own_writes(backend: str) -> None:
    seen = meshsim.run(_variables_and_writes, 4, backend=backend)
    assert seen == [(str(r), str(r), "4", "4", str(r), str(r)) for r in range(4)]
    assert "MESHSIM_TEST_MINE" not in os.environ  # the caller's environment is untouched
    assert "RANK" not in os.environ or os.environ["RANK"] != "3"


def _chdir(target: str) -> str:
    os.chdir(target)
    return os.getcwd()


def test_chdir_on_the_fake_tier_is_undone_after_each_rank(tmp_path: Path) -> None:
    before = os.getcwd()
    assert meshsim.run(_chdir, 2, backend="fake", args=(str(tmp_path),)) == [str(tmp_path)] * 2
    assert os.getcwd() == before


def test_chdir_on_the_threaded_tier_is_refused_with_the_reason(tmp_path: Path) -> None:
    before = os.getcwd()
    with pytest.raises(meshsim.RankFailure) as caught:
        meshsim.run(_chdir, 2, backend="threaded", args=(str(tmp_path),))
    assert "threaded ranks are threads of one process and share one working directory" in str(
        caught.value
    )
    assert os.getcwd() == before


def test_chdir_on_gloo_is_the_ranks_own(tmp_path: Path) -> None:
    before = os.getcwd()
    assert meshsim.run(_chdir, 2, backend="gloo", args=(str(tmp_path),)) == [str(tmp_path)] * 2
    assert os.getcwd() == before
