"""The ``meshsim`` console script ends with ``os._exit`` after running what a normal exit runs
(``meshsim.cli.main.console``): the reports, the atexit clean-up and the exit code must all
be as they were with ``SystemExit``. Each test runs ``python -m meshsim`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import run_cli


def _meshsim(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"TMPDIR": str(tmp)})  # env: always a subprocess


def _ours(tmp: Path) -> list[str]:
    """meshsim's temp folders in ``tmp`` (torch 2.15 leaves its inductor cache there, by
    design, as on any exit)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("meshsim-"))


def test_a_gloo_check_and_sweep_leave_no_temp_file_and_write_their_reports(
    tmp_path: Path,
) -> None:
    """The gloo pool's rendezvous folder is removed by an atexit handler: still run. (The
    next meshsim process would remove a dead one's folders, so each run is checked alone.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    verified = _meshsim("verify", "torch", "-n", "2", "--backend", "gloo", tmp=tmp)
    assert verified.returncode == 0, verified.stderr
    assert _ours(tmp) == []  # checked now: the next run would remove a dead one's folders
    report = tmp_path / "sweep.json"
    swept = _meshsim(
        "sweep", "-n", "4", "--framework", "torch", "--backend", "gloo", "--limit", "2",
        "--json", str(report), tmp=tmp,
    )  # fmt: skip
    assert swept.returncode == 0, swept.stderr
    data = json.loads(report.read_text())
    assert data["exit_code"] == 0 and len(data["results"]) == 2
    assert _ours(tmp) == []


def test_stdout_is_whole_and_exit_codes_are_kept(tmp_path: Path) -> None:
    shown = _meshsim("show", "megatron", "-n", "64", "--tp", "4", "--json", "--all-groups",
                     tmp=tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["verb"] == "show"  # flushed to its last byte
    refused = _meshsim("show", "megatron", "-n", "6", "--tp", "4", tmp=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    unknown = _meshsim("shwo", tmp=tmp_path)
    assert unknown.returncode == 2 and "meshsim: error" in unknown.stderr
    assert _meshsim("--version", tmp=tmp_path).returncode == 0


_LINGERING = """
import atexit, sys, threading
from meshsim.cli.main import _exit_now
stay = threading.Event()
threading.Thread(target=stay.wait, name="a framework's helper").start()  # never set: it stays
atexit.register(lambda: print("atexit ran", flush=True))
_exit_now(int(sys.argv[1]))
"""


def test_a_stopped_command_does_not_wait_for_a_thread_that_stays() -> None:
    """After Ctrl-C (130) or SIGTERM (143) a framework's thread cut short in its step may
    never end: the exit waits for it a bounded time, runs the atexit handlers and keeps the
    code. A normal exit still waits for it (shown by the timeout: the thread never ends)."""
    for code in (130, 143):
        done = subprocess.run(
            [sys.executable, "-c", _LINGERING, str(code)], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == code, done.stderr
        assert done.stdout == "atexit ran\n"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", _LINGERING, "0"], capture_output=True, timeout=10)
