"""sweep's reports: progress lines off a terminal, partial JSON/JUnit on SIGINT/SIGTERM, the
per-tier summary, and the communicate sample."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshsim.cli.sweep import plan, sample
from meshsim.model.sweep import layouts
from tests.cli.helpers import ROOT, run_cli


def _sweep_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"cross_check": False, "backend": "fake", "communicate": 0}
    values.update(overrides)
    return argparse.Namespace(**values)


def test_communicate_sample_is_evenly_spaced_per_convention() -> None:
    cases = layouts(8, "torch") + layouts(8, "deepspeed")
    chosen = sample(cases, 3)
    torch_n = len(layouts(8, "torch"))
    assert chosen == [0, round((torch_n - 1) / 2), torch_n - 1, *chosen[3:]]
    assert len(chosen) == 6 and {cases[i].framework for i in chosen} == {"torch", "deepspeed"}
    assert sample(cases, 1) == [0, torch_n]
    steps = plan(_sweep_args(communicate=3), cases)
    assert [(tier, len(ix)) for tier, ix in steps] == [
        ("fake", len(cases)),
        ("threaded", 6),
        ("gloo", 6),
    ]
    assert plan(_sweep_args(), cases) == [("fake", list(range(len(cases))))]


def test_sweep_json_on_stdout_with_per_tier_summary_and_progress_lines() -> None:
    result = run_cli("sweep", "-n", "4", "--framework", "torch", "--limit", "3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # stdout is the JSON object alone
    assert data["verb"] == "sweep" and data["exit_code"] == 0 and data["complete"] is True
    assert data["layouts_done"] == data["layouts_total"] == 3 and data["interrupted"] is None
    assert data["summary"] == [
        {
            "framework": "torch",
            "tier": "fake",
            "layouts": 3,
            "passed": 3,
            "failed": 0,
            "groups_proven": 0,
            "build_seconds": pytest.approx(data["summary"][0]["build_seconds"]),
        }
    ]
    # Not a terminal: plain progress lines on stderr, the table too (stdout holds JSON only).
    assert "meshsim sweep: fake 0/3 layouts, 0 failed" in result.stderr
    assert "meshsim sweep: fake 3/3 layouts, 0 failed" in result.stderr
    assert "groups proven by all-gather" in result.stderr
    assert "build+check s (sum)" in result.stderr


def test_sweep_help_quotes_no_stale_layout_count() -> None:
    text = run_cli("sweep", "--help").stdout
    assert "759" not in text and "779" not in text
    assert "--communicate" in text


def _start_sweep(tmp_path: Path, delay: float = 1.0) -> tuple[subprocess.Popen[str], Path, Path]:
    out_json, out_xml = tmp_path / "sweep.json", tmp_path / "sweep.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshsim",
            "sweep",
            "-n",
            "8",
            "--jobs",
            "1",
            "--json",
            str(out_json),
            "--junit-xml",
            str(out_xml),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    # A hang guard only: the first progress line comes after torch's import.
    if not select.select([proc.stderr], [], [], 600)[0]:
        proc.kill()
        pytest.fail("the sweep printed nothing in 600 s")
    first = proc.stderr.readline()  # the first progress line: the sweep is running
    assert "meshsim sweep: fake 0/" in first, first
    time.sleep(delay)
    return proc, out_json, out_xml


@pytest.mark.parametrize("delay", [0.3, 1.0])
@pytest.mark.parametrize(
    ("sig", "name", "code"), [(signal.SIGINT, "SIGINT", 130), (signal.SIGTERM, "SIGTERM", 143)]
)
def test_interrupted_sweep_writes_valid_partial_reports(
    tmp_path: Path, sig: signal.Signals, name: str, code: int, delay: float
) -> None:
    """The signal may land anywhere, torch's imports included (early, 0.3 s, is mostly there):
    an exception raised there used to abort the process or turn exit 130 into death by SIGINT,
    about one run in six."""
    proc, out_json, out_xml = _start_sweep(tmp_path, delay)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=600)  # a hang guard only
    assert proc.returncode == code, (stdout, stderr)
    assert "Traceback" not in stderr
    assert f"interrupted by {name}" in stdout
    data = json.loads(out_json.read_text())
    assert data["interrupted"] == name and data["complete"] is False
    assert data["exit_code"] == code
    assert data["layouts_done"] == len(data["results"]) < data["layouts_total"]
    assert data["layouts_total"] == sum(len(layouts(8, f)) for f in _conventions())
    root = ET.parse(out_xml).getroot()
    suite = root.find("testsuite")
    assert suite is not None and suite.get("errors") == "1"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["interrupted"] == name
    assert int(props["layouts_done"]) == data["layouts_done"]
    errors = [case for case in suite.iter("testcase") if case.find("error") is not None]
    assert [case.get("name") for case in errors] == ["interrupted"]
    assert not list(tmp_path.glob("*.partial"))


def _conventions() -> list[str]:
    from meshsim.model.conventions import CONVENTIONS

    return list(CONVENTIONS)


@pytest.mark.slow
def test_communicate_proves_a_sample_on_threaded_and_gloo() -> None:
    result = run_cli(
        "sweep",
        "-n",
        "4",
        "--framework",
        "torch",
        "--limit",
        "3",
        "--communicate",
        "2",
        "--json",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {row["tier"]: row for row in data["summary"]}
    assert rows["fake"]["layouts"] == 3 and rows["fake"]["groups_proven"] == 0
    for tier in ("threaded", "gloo"):
        assert rows[tier]["layouts"] == 2 and rows[tier]["failed"] == 0
        assert rows[tier]["groups_proven"] > 0
    assert all(r["agree"] for r in data["results"])
