"""Ctrl-C and SIGTERM stop a real ``meshsim sweep`` process wherever it is (its workers still
importing torch, between fake batches, inside a gloo world): exit 130 / 143, no traceback,
``--json`` and ``--junit-xml`` written with true counts, and no process it started left.

Ctrl-C is sent as a terminal sends it, to the sweep's whole process group; SIGTERM as ``kill``
sends it, to the sweep's pid only. Each test waits for a condition the sweep makes visible (a
worker process, a progress line, the gloo ranks) rather than a fixed time; how long the sweep
then takes to stop is measured by ``benchmarks/sweep_stop.py``, not asserted here.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from meshsim.model.sweep import layouts
from tests.cli.helpers import ROOT
from tests.cli.json_schema import errors
from tests.cli.test_json_schemas import schema

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
#: A hang guard only: a loaded machine may take minutes to import torch and boot gloo.
PATIENCE_S = 600.0


class Sweep:
    """``python -m meshsim sweep ARGS`` in a process group of its own, as a shell starts a
    foreground job; its stderr read line by line as it comes."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.json, self.xml = tmp_path / "sweep.json", tmp_path / "sweep.xml"
        env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
        reports = ["--json", str(self.json), "--junit-xml", str(self.xml)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshsim", "sweep", *args, *reports],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.seen: set[int] = set()  # every process below the sweep, whenever it was seen
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put("")

    def wait_for_line(self, pattern: str) -> re.Match[str]:
        """The first stderr line matching ``pattern`` from here on."""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                self.descendants()
                continue
            if not line:
                break
            self.stderr.append(line)
            self.descendants()
            found = re.search(pattern, line)
            if found:
                return found
        self.proc.kill()
        pytest.fail(f"no stderr line matched {pattern!r}:\n{''.join(self.stderr)}")

    def wait_for_processes(self, wanted: Callable[[list[str]], bool]) -> None:
        """Until ``wanted`` holds for the command lines of the processes below the sweep."""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            if wanted([_cmdline(pid) for pid in self.descendants()]):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.proc.kill()
        pytest.fail("the sweep never started the processes waited for")

    def descendants(self) -> list[int]:
        found = descendants(self.proc.pid)
        self.seen.update(found)
        return found

    def stop(self, sig: signal.Signals) -> tuple[str, str]:
        """Send ``sig`` as a terminal (SIGINT: the process group) or ``kill`` (SIGTERM: the
        pid) would; return stdout and the whole stderr once the sweep has exited."""
        self.descendants()
        if sig == signal.SIGINT:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        stdout = self.proc.stdout.read() if self.proc.stdout is not None else ""
        self.proc.wait(PATIENCE_S)
        try:
            while (line := self.lines.get(timeout=60)) != "":
                self.stderr.append(line)
        except queue.Empty:  # something the sweep started still holds its stderr open
            pytest.fail(f"stderr still open after exit; running: {running(self.seen)}")
        return stdout, "".join(self.stderr)


def descendants(pid: int) -> list[int]:
    """Every live process whose chain of parents reaches ``pid`` (sessions of their own
    included, as the gloo ranks have), read from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = _stat(int(entry))
            if state is not None and state[0] != "Z":
                parents.setdefault(state[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running(pids: set[int]) -> list[int]:
    """Those of ``pids`` still running: neither gone nor a zombie (dead, not yet reaped)."""
    deadline = time.monotonic() + 30  # a guard: SIGKILL takes effect as soon as scheduled
    left = sorted(pids)
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if (_stat(pid) or ("Z",))[0] != "Z"]
        if left:
            time.sleep(0.05)
    return left


def _check_reports(sweep: Sweep, name: str, code: int, total: int) -> dict[str, object]:
    """The JSON and JUnit reports: complete files, marked interrupted, counts that agree."""
    data = json.loads(sweep.json.read_text())
    assert errors(data, schema("sweep")) == []
    assert data["interrupted"] == name and data["complete"] is False
    assert data["exit_code"] == code
    assert data["layouts_total"] == total
    assert data["layouts_done"] == len(data["results"]) < total
    assert data["passed"] + data["failed"] == len(data["results"])
    suite = ET.parse(sweep.xml).getroot().find("testsuite")
    assert suite is not None and suite.get("errors") == "1"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["interrupted"] == name
    assert int(props["layouts_done"]) == data["layouts_done"]
    cases = [c for c in suite.iter("testcase") if c.get("name") != "interrupted"]
    assert len(cases) == data["layouts_done"]
    assert not list(sweep.json.parent.glob("*.partial"))
    return data


def _check_exit(sweep: Sweep, sig: signal.Signals, stdout: str, stderr: str) -> None:
    code = 130 if sig == signal.SIGINT else 143
    assert sweep.proc.returncode == code, (stdout, stderr)
    assert "Traceback" not in stderr + stdout, stderr
    assert f"interrupted by {sig.name}" in stdout
    assert sweep.seen, "no process below the sweep was ever seen: the check below is empty"
    assert running(sweep.seen) == [], [_cmdline(p) for p in running(sweep.seen)]


def _total(world: int, frameworks: list[str]) -> int:
    return sum(len(layouts(world, f)) for f in frameworks)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_at_start_up_stops_the_booting_worker(tmp_path: Path, sig: signal.Signals) -> None:
    """The sweep has planned and its worker is still starting (importing torch)."""
    sweep = Sweep(tmp_path, "-n", "8", "--framework", "megatron", "--jobs", "1")
    sweep.wait_for_line(r"meshsim sweep: fake 0/\d+ layouts.* started")
    sweep.wait_for_processes(lambda lines: any("sweep_remote" in c for c in lines))
    stdout, stderr = sweep.stop(sig)
    _check_exit(sweep, sig, stdout, stderr)
    _check_reports(sweep, sig.name, 130 if sig == signal.SIGINT else 143, _total(8, ["megatron"]))


@pytest.mark.parametrize(
    ("sig", "jobs"),
    [(signal.SIGINT, "2"), pytest.param(signal.SIGTERM, "1", marks=pytest.mark.slow)],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_mid_sweep_keeps_every_result_that_arrived(
    tmp_path: Path, sig: signal.Signals, jobs: str
) -> None:
    """Results have arrived (a progress line counts them, and the sweep has not finished:
    over a thousand layouts at world 16) and more are being built: the reports hold them all."""
    frameworks = ["megatron", "torchtitan"]
    sweep = Sweep(tmp_path, "-n", "16", *[f"--framework={f}" for f in frameworks], "-j", jobs)
    counted = sweep.wait_for_line(
        r"meshsim sweep: fake ([1-9]\d*)/\d+ layouts, \d+ failed, \d+ s(, about .* left)?$"
    )
    stdout, stderr = sweep.stop(sig)
    _check_exit(sweep, sig, stdout, stderr)
    code = 130 if sig == signal.SIGINT else 143
    data = _check_reports(sweep, sig.name, code, _total(16, frameworks))
    assert data["layouts_done"] >= int(counted.group(1))  # each result counted is reported


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_inside_a_gloo_check_kills_its_rank_processes(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The gloo tier's rank processes exist (in sessions of their own, forked by the pool's
    template): none survives the sweep."""
    sweep = Sweep(tmp_path, "-n", "4", "--framework", "torch", "--backend", "gloo")
    sweep.wait_for_line(r"meshsim sweep: gloo 0/\d+ layouts.* started")
    sweep.wait_for_processes(lambda lines: sum("meshsim.harness" in c for c in lines) >= 4)
    stdout, stderr = sweep.stop(sig)
    _check_exit(sweep, sig, stdout, stderr)
    _check_reports(sweep, sig.name, 130 if sig == signal.SIGINT else 143, _total(4, ["torch"]))


def test_kill_tree_reaches_processes_in_sessions_of_their_own() -> None:
    """What the sweep does to each worker on a stop, without the workers' own exit when their
    parent goes: grandchildren in new sessions (as the gloo ranks are), which a process group
    kill would miss and which nothing else would end for ten minutes."""
    from meshsim.cli.sweep_workers import kill_tree

    code = (
        "import subprocess, sys, time\n"
        "new = dict(start_new_session=True)\n"
        "sleepers = [subprocess.Popen(['sleep', '600'], **new) for _ in range(2)]\n"
        "print(*[p.pid for p in sleepers], flush=True)\n"
        "time.sleep(600)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert middle.stdout is not None
    sleepers = {int(pid) for pid in middle.stdout.readline().split()}
    assert len(sleepers) == 2 and set(descendants(middle.pid)) == sleepers
    kill_tree(middle.pid)
    assert middle.wait(PATIENCE_S) == -signal.SIGKILL
    assert running(sleepers) == []
