"""How fast ``meshsim sweep`` stops on Ctrl-C / SIGTERM, and what it leaves (issue 31 item 2).

A real ``python -m meshsim sweep`` is started in a process group of its own; at a point the
sweep makes visible (its worker process exists, a progress line counts results, the gloo
ranks exist) it gets SIGINT on its group (a terminal's Ctrl-C) or SIGTERM on its pid (``kill``).
Measured: seconds from the signal to the sweep's exit (reports written, workers killed), the
exit code, the layouts its JSON reports done, and the processes below it still running 5 s
after it exited (gone or zombie counts as not running). The tests in
``tests/cli/test_sweep_signals.py`` assert the behaviour; this measures the latency, which
tests must not assert.

    python benchmarks/sweep_stop.py [--quick] [--json out.json]
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, fmt_s, job_free_env, loadavg, md_table, section_main

#: (name, sweep arguments, where to signal, signal). Where: "worker" (its worker process
#: exists: start-up), "result" (a progress line counts a result: mid-sweep), "ranks" (at
#: least 4 gloo rank processes exist: inside a live check).
SCENARIOS = (
    ("start-up, Ctrl-C", ["-n", "64"], "worker", signal.SIGINT),
    ("mid-sweep, Ctrl-C", ["-n", "64"], "result", signal.SIGINT),
    ("mid-sweep, SIGTERM", ["-n", "64", "--framework", "megatron"], "result", signal.SIGTERM),
    (
        "gloo check, Ctrl-C",
        ["-n", "8", "--framework", "torch", "--backend", "gloo"],
        "ranks",
        signal.SIGINT,
    ),
)


def one(args: list[str], where: str, sig: signal.Signals, folder: Path) -> dict[str, Any]:
    report = folder / "sweep.json"
    report.unlink(missing_ok=True)
    env = job_free_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshsim", "sweep", *args, "--json", str(report)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr or ():
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    seen: set[int] = set()
    start = time.monotonic()
    while time.monotonic() - start < 900:
        below = _descendants(proc.pid)
        seen.update(below)
        commands = [_cmdline(p) for p in below]
        if where == "worker" and any("sweep_remote" in c for c in commands):
            break
        if where == "ranks" and sum("meshsim.harness" in c for c in commands) >= 4:
            break
        if where == "result" and any(re.search(r" [1-9]\d*/\d+ layouts", x) for x in lines):
            break
        time.sleep(0.02)
    signalled = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    proc.wait()
    latency = time.monotonic() - signalled
    time.sleep(5)
    left = [p for p in seen if (_state(p) or "Z") != "Z"]
    data = json.loads(report.read_text()) if report.exists() else {}
    return {
        "stop_s": latency,
        "signal_after_s": signalled - start,
        "exit_code": proc.returncode,
        "done": data.get("layouts_done"),
        "total": data.get("layouts_total"),
        "processes_seen": len(seen),
        "still_running": len(left),
        "traceback": "Traceback" in "".join(lines),
    }


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run(quick: bool) -> dict[str, Any]:
    rounds = 1 if quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, args, where, sig in SCENARIOS:
            samples = [one(args, where, sig, Path(folder)) for _ in range(rounds)]
            rows.append(
                {
                    "scenario": name,
                    "command": "meshsim sweep " + " ".join(args),
                    "median_stop_s": statistics.median(s["stop_s"] for s in samples),
                    "samples": samples,
                    "load_average": loadavg(),
                }
            )
    return {"rows": rows, "rounds": rounds}


def render(result: dict[str, Any]) -> str:
    head = ["scenario", "command", "signal to exit", "exit", "done / total", "left running"]
    body = []
    for row in result["rows"]:
        last = row["samples"][-1]
        body.append(
            [
                row["scenario"],
                f"`{row['command']}`",
                fmt_s(row["median_stop_s"]),
                ", ".join(str(s["exit_code"]) for s in row["samples"]),
                f"{last['done']} / {last['total']}",
                ", ".join(str(s["still_running"]) for s in row["samples"]),
            ]
        )
    note = (
        f"Median of {result['rounds']} run(s) each; signal to exit includes killing the "
        "workers and writing the JSON. 'left running': processes below the sweep still "
        "running 5 s after it exited, per run."
    )
    return md_table(head, body) + "\n\n" + note


def main() -> None:
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
