"""sweep's reports: progress lines off a terminal, the per-tier summary, and the communicate
sample (partial reports on SIGINT/SIGTERM: test_sweep_signals.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from meshsim.cli.sweep import plan, sample
from meshsim.model.sweep import layouts
from tests.cli.helpers import run_cli


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


def test_later_steps_run_on_and_sample_from_the_layouts_the_first_step_kept() -> None:
    """--within-node leaves layouts out in the first step; the samples come from the rest."""
    cases = layouts(8, "torch")
    every, kept = list(range(len(cases))), [1, 3, 5, 7]
    steps = plan(_sweep_args(communicate=2), cases, kept)
    assert steps == [("fake", every), ("threaded", [1, 7]), ("gloo", [1, 7])]
    crossed = plan(_sweep_args(cross_check=True, backend=None), cases, kept)
    assert crossed == [("fake", every), ("threaded", kept), ("gloo", kept)]


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
