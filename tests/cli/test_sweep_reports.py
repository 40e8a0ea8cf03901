"""sweep's reports: progress lines off a terminal, the per-tier summary, and the communicate
sample (partial reports on SIGINT/SIGTERM: test_sweep_signals.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from meshsim.cli.sweep_plan import Step, distinct, live_steps, spaced
from meshsim.model.fingerprint import group_fingerprint
from meshsim.model.sweep import layouts
from tests.cli.helpers import run_cli


def _sweep_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "cross_check": False,
        "backend": "fake",
        "communicate": 0,
        "sample": None,
        "real": False,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def test_communicate_sample_is_evenly_spaced_per_convention() -> None:
    cases = layouts(8, "torch") + layouts(8, "deepspeed")
    every = list(range(len(cases)))
    chosen = spaced(cases, every, 3)
    torch_n = len(layouts(8, "torch"))
    assert chosen == [0, round((torch_n - 1) / 2), torch_n - 1, *chosen[3:]]
    assert len(chosen) == 6 and {cases[i].framework for i in chosen} == {"torch", "deepspeed"}
    assert spaced(cases, every, 1) == [0, torch_n]
    steps = live_steps(_sweep_args(communicate=3), cases, every, {})
    assert [(step.tier, len(step.indices)) for step in steps] == [
        ("fake", len(cases)),
        ("threaded", 6),
        ("gloo", 6),
    ]
    assert live_steps(_sweep_args(), cases, every, {}) == [Step("fake", every)]


def test_later_steps_run_on_and_sample_from_the_layouts_the_reference_kept() -> None:
    """--within-node leaves layouts out in the reference step; the live steps build the
    rest, and the samples come from them."""
    cases = layouts(8, "torch")
    kept = [1, 3, 5, 7]
    steps = live_steps(_sweep_args(communicate=2), cases, kept, {})
    assert steps == [Step("fake", kept), Step("threaded", [1, 7]), Step("gloo", [1, 7])]
    crossed = live_steps(_sweep_args(cross_check=True, backend=None), cases, kept, {})
    assert crossed == [Step("fake", kept), Step("threaded", kept), Step("gloo", kept)]


def test_layouts_that_build_the_same_groups_share_one_live_proof() -> None:
    """Each distinct group structure is built on every rank once; a layout that repeats one
    is built on three fake ranks (its own code path, its own reference), and the
    communicating samples come from the distinct ones only."""
    cases = layouts(8, "megatron")
    every = list(range(len(cases)))
    fingerprints = [group_fingerprint(c.expect()) for c in cases]
    representatives, shares = distinct(cases, fingerprints, every)
    assert len(representatives) + len(shares) == len(cases)
    assert len(representatives) == len(set(fingerprints)) < len(cases) / 1.5
    for member, first in shares.items():
        assert first < member and fingerprints[first] == fingerprints[member]
    # Configs that differ only in where degree-1 dims sit in the order build the same groups.
    plain = next(i for i, c in enumerate(cases) if c.config.get("tensor_model_parallel_size") == 8)
    assert any(shares.get(i) == plain for i in every)
    steps = live_steps(_sweep_args(communicate=2), cases, every, shares)
    assert steps[0] == Step("fake", representatives)
    assert steps[1] == Step("fake", sorted(shares), (0, 4, 7))
    assert steps[1].label == "fake on ranks 0,4,7"
    assert set(steps[2].indices) <= set(representatives) and steps[2].tier == "threaded"
    # --sample builds N distinct structures a framework, and no repeat.
    sampled = live_steps(_sweep_args(sample=5), cases, every, shares)
    assert [s.tier for s in sampled] == ["fake"] and len(sampled[0].indices) == 5
    assert set(sampled[0].indices) <= set(representatives)


@pytest.mark.parametrize("framework", ["megatron", "accelerate"])
def test_a_frameworks_own_code_is_never_moved_to_the_fake_tier(framework: str) -> None:
    """--real builds every layout in full on the asked tier: the fake tier cannot run all of
    the frameworks' code (megatron's gloo groups) nor observe it (accelerate's data-loading
    peers are found by communicating: 15 of its 27 world-4 layouts failed falsely there)."""
    cases = layouts(8, framework)
    every = list(range(len(cases)))
    fingerprints = [group_fingerprint(c.expect()) for c in cases]
    _, shares = distinct(cases, fingerprints, every)
    assert shares  # there are repeats to move, and none is moved
    steps = live_steps(_sweep_args(backend="gloo", real=True), cases, every, shares)
    assert steps == [Step("gloo", every)]


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
