"""Failure messages: merged identical failures, compressed rank lists, how a rank died."""

from __future__ import annotations

from meshsim.harness import RankOutcome
from meshsim.harness.outcome import (
    compress_ranks,
    death_cause,
    failure_message,
    format_group,
    rank_label,
    signal_name,
)


def test_compress_ranks() -> None:
    assert compress_ranks([3, 0, 1, 2]) == "0-3"
    assert compress_ranks([2, 3]) == "2, 3"
    assert compress_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3, 6, 8, 9"
    assert rank_label([5]) == "rank 5"
    assert rank_label([2, 3]) == "ranks 2, 3"


def test_death_cause_and_signal_names() -> None:
    assert signal_name(11) == "SIGSEGV" and signal_name(9) == "SIGKILL"
    assert death_cause(None, "SIGSEGV") == "killed by SIGSEGV"
    assert death_cause(3, None) == "exited with code 3"


def test_groups_are_named() -> None:
    assert format_group(None) == "the world"
    assert format_group((0, 1, 2, 3)) == "group (0,1,2,3)"
    assert format_group(tuple(range(100))) == "group (0,1,2,3,...,99) [100 ranks]"


def test_failure_message_merges_and_orders() -> None:
    err = {
        "status": "error",
        "error_type": "AssertionError",
        "error_message": "bad",
        "traceback": "Traceback...\nAssertionError: bad\n",
    }
    outcomes = [
        RankOutcome(0, value=1),
        RankOutcome(1, status="died", signal_name="SIGSEGV", output="Fatal Python error"),
        RankOutcome(2, **err),
        RankOutcome(3, **err),
        RankOutcome(4, status="aborted", collective="all_reduce on the world (call #1)"),
    ]
    text = failure_message("header", outcomes)
    lines = text.splitlines()
    assert lines[:4] == [
        "header",
        "rank 1 died: killed by SIGSEGV",
        "ranks 2, 3: AssertionError: bad",
        "rank 4: aborted after another rank failed (in all_reduce on the world (call #1))",
    ]
    assert "--- traceback of rank 2 ---" in text and "--- traceback of rank 3 ---" not in text
    assert "Fatal Python error" in text


def test_stale_dirs_of_dead_processes_are_swept(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from meshsim.harness import rendezvous

    monkeypatch.setattr(rendezvous.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / f"meshsim-{dead}-job-abc").mkdir()
    mine = rendezvous.make_dir("job")
    (tmp_path / "unrelated").mkdir()
    assert rendezvous.sweep_stale() == [f"meshsim-{dead}-job-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["unrelated", mine.rsplit("/")[-1]])
    rendezvous.remove_dir(mine)
