"""``meshsim verify`` and ``meshsim sweep``: live checks end to end, pass and fail paths."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import meshsim
from meshsim.checks import GroupView, Observation, diff
from meshsim.cli import sweep as sweeping
from meshsim.cli.main import main
from meshsim.cli.sweep_remote import Examined
from meshsim.model.sweep import LayoutCase
from tests.cli.helpers import ROOT, assert_bad_input, json_of, run_cli
from tests.releases import needs_unflatten

verify_module = pytest.importorskip("meshsim.verify", reason="meshsim.verify not built yet")
VerifyResult = verify_module.VerifyResult


def test_verify_fake_passes_with_a_table() -> None:
    result = run_cli("verify", "megatron", "-n", "8", "--tp", "2", "--pp", "2", "--backend", "fake")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "PASS: 25 kinds checked" in out
    row = next(line for line in out.splitlines() if line.startswith("│ tp "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells == ["tp", "4", "2", "fake", "yes", "no (fake tier)"]
    assert "fake tier: backends are not compared" in out


def test_verify_gloo_proves_groups_by_all_gather() -> None:
    result = run_cli("verify", "olmo-core", "-n", "4", "--dp", "fsdp", "--cp", "2", "--json")
    data = json_of(result)
    assert result.returncode == 0 and data["passed"] is True
    assert data["backend"] == "gloo"  # verify's default tier communicates
    assert "get_dp_model_mesh" in data["kinds_checked"]
    out = run_cli("verify", "torch", "-n", "2", "--tp", "2").stdout
    row = next(line for line in out.splitlines() if line.startswith("│ tp "))
    assert row.rstrip("│ ").endswith("yes")


def test_verify_real_without_the_framework_names_the_extra(tmp_path: Path) -> None:
    # sitecustomize marks megatron as not installed (find_spec -> None, import fails)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['megatron'] = None\n")
    result = run_cli(
        "verify",
        "megatron",
        "-n",
        "2",
        "--real",
        "--backend",
        "fake",
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    assert_bad_input(result, "pip install 'meshsim[megatron]'")


def test_megatron_on_fake_is_refused_only_where_its_code_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fake-tier refusal is about megatron's own gloo groups: where megatron is missing a
    sweep --real leaves it out, so the other frameworks still run on fake."""
    from meshsim.builders import real
    from meshsim.cli.main import _check_tier
    from meshsim.errors import UsageError

    args = argparse.Namespace(
        verb="sweep", backend="fake", world_size=2, cross_check=False, real=True, frameworks=None
    )
    monkeypatch.setattr(real, "unavailable", lambda name: None)
    with pytest.raises(UsageError, match="create_gloo_process_groups"):
        _check_tier(args)
    monkeypatch.setattr(real, "unavailable", lambda name: f"{name} is not installed")
    _check_tier(args)  # megatron runs nowhere here: no reason to refuse the fake tier


def _wrong_observations(expected: meshsim.Expected) -> list[Observation]:
    """What ranks would see if tp groups were strided instead of consecutive."""
    world = expected.world_size
    return _tp_observations(world, lambda rank: tuple(r for r in range(world) if r % 4 == rank % 4))


def _tp_observations(world: int, tp_of: Any) -> list[Observation]:
    """Each rank's Observation holding only its ``tp`` group, ``tp_of(rank)``, on gloo."""
    out = []
    for rank in range(world):
        members = tuple(tp_of(rank))
        view = GroupView("tp", members, members.index(rank), backends=("gloo",))
        out.append(Observation(rank, world, "gloo", {"tp": view}))
    return out


def test_verify_mismatch_prints_the_diff_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = meshsim.expect("megatron", 8, tensor_model_parallel_size=2)
    mismatch = diff(_wrong_observations(expected), expected, ["tp"])
    assert mismatch is not None

    def fake_verify(framework: str, world: int, backend: str, **kw: Any) -> Any:
        return VerifyResult(framework, world, {}, backend, False, mismatch, ("tp",), 0.1, None)

    monkeypatch.setattr(verify_module, "verify", fake_verify)
    assert main(["verify", "megatron", "-n", "8", "--tp", "2"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "tp: rank 1 holds (1, 5); expected (0, 1)" in out
    assert "FAIL" in out


def test_verify_checks_every_kind_of_deepspeed_p2p_included() -> None:
    """The p2p pairs (pipeline neighbour direction) are a kind verify compares, not a gap."""
    result = verify_module.verify("deepspeed", 8, "threaded", num_pp=4, num_dp=2)
    assert result.passed, str(result)
    assert "p2p" in result.kinds_checked and result.skipped == {}
    expected = meshsim.expect("deepspeed", 8, num_pp=4, num_dp=2)
    assert set(result.kinds_checked) == set(expected.kinds()) | set(expected.unavailable())


def test_kinds_no_rank_observed_are_reported_as_skipped_with_why() -> None:
    """A builder that leaves a kind out does not pass silently on the kinds it did observe."""
    expected = meshsim.expect("megatron", 8, tensor_model_parallel_size=2)
    built = [(obs, 0.0) for obs in _right_tp_only(expected)]
    args = ("megatron", 8, {"tensor_model_parallel_size": 2}, True)
    result = verify_module._judge(args, "gloo", expected, built)
    assert result.kinds_checked == ("tp",) and result.passed
    assert set(result.skipped) == (set(expected.kinds()) | set(expected.unavailable())) - {"tp"}
    assert result.skipped["dp"] == (
        "the real megatron adapter does not observe it (no rank recorded a group or its absence)"
    )


def _right_tp_only(expected: meshsim.Expected) -> list[Observation]:
    return _tp_observations(expected.world_size, lambda rank: expected.group_of(rank, "tp"))


def test_verify_prints_skipped_kinds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = meshsim.expect("megatron", 8, tensor_model_parallel_size=2)
    built = [(obs, 0.0) for obs in _right_tp_only(expected)]

    def partial_verify(framework: str, world: int, backend: str, **kw: Any) -> Any:
        args = (framework, world, {"tensor_model_parallel_size": 2}, False)
        return verify_module._judge(args, backend, expected, built)

    monkeypatch.setattr(verify_module, "verify", partial_verify)
    assert main(["verify", "megatron", "-n", "8", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped dp: meshsim's megatron builder does not observe it" in out


def test_sweep_fake_json_and_junit(tmp_path: Path) -> None:
    report, junit = tmp_path / "sweep.json", tmp_path / "junit.xml"
    # 43 olmo-core layouts: two chunks, verified side by side in 2 worker processes
    result = run_cli(
        "sweep",
        "-n",
        "4",
        "--framework",
        "olmo-core",
        "-j",
        "2",
        "--json",
        str(report),
        "--junit-xml",
        str(junit),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sweep of world 4 on fake" in result.stdout
    data = json.loads(report.read_text())
    cases = meshsim.layouts(4, "olmo-core")
    assert len(cases) > verify_module.FAKE_BATCH
    assert [r["id"] for r in data["results"]] == [c.id for c in cases]  # input order kept
    assert data["failed"] == 0 and all(r["tiers"]["fake"]["passed"] for r in data["results"])
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == str(len(cases))
    assert suite.get("failures") == "0"
    names = [case.get("name") for case in suite.iter("testcase")]
    assert names == [c.id for c in cases]


def test_sweep_cross_check_runs_every_tier() -> None:
    result = run_cli("sweep", "-n", "2", "--framework", "torch", "--cross-check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sweep of world 2 on fake, threaded, gloo" in result.stdout
    total = next(line for line in result.stdout.splitlines() if "total" in line)
    # framework, tier, layouts, passed, failed, groups proven (threaded + gloo: 134 each; the
    # sweep lists the torch options that change groups: rank tensors, _unflatten, backends)
    assert [c.strip() for c in total.strip("│").split("│")][2:6] == ["16", "16", "0", "268"]


def _result(case: LayoutCase, tier: str, mismatch: Any = None) -> Any:
    return VerifyResult(
        case.framework, case.world_size, case.config, tier, False, mismatch, ("tp",), 0.01, None
    )


def test_sweep_fails_when_tiers_disagree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = meshsim.expect("megatron", 8, tensor_model_parallel_size=2)
    mismatch = diff(_wrong_observations(expected), expected, ["tp"])
    cases = meshsim.layouts(8, "megatron")[:3]

    class InProcess:
        """The sweep's workers answering here, one tier seeing another group on one layout."""

        def __init__(self, jobs: int) -> None:
            pass

        def run(
            self, chunks: Any, stop: Any, *, parallel: bool, tick: Any = None
        ) -> Iterator[tuple[int, int, Any]]:
            for c, chunk in enumerate(chunks):
                for i, case in enumerate(chunk.cases):
                    broken = chunk.tier == "threaded" and case == cases[1]
                    result = _result(case, chunk.tier, mismatch if broken else None)
                    yield c, i, Examined(result, [] if chunk.first else None)

        def close(self, stop: Any) -> None:
            pass

        def kill(self) -> None:
            pass

    monkeypatch.setattr(sweeping, "collect_cases", lambda *a: cases)
    monkeypatch.setattr(sweeping, "Workers", InProcess)
    junit = tmp_path / "j.xml"
    assert main(["sweep", "-n", "8", "--cross-check", "--junit-xml", str(junit)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {cases[1].id}" in out and "tiers observed different groups" in out
    failures = ET.parse(junit).getroot().iter("failure")
    assert [f.get("message", "").startswith("tiers observed") for f in failures] == [True]


def test_outcome_agreement_ignores_result_order() -> None:
    case = LayoutCase("torch", 2, {})
    outcome = sweeping.Outcome(case, {t: _result(case, t) for t in sweeping.TIERS})
    assert outcome.passed and outcome.agree


def test_verify_under_torchrun_runs_on_the_job_ranks_and_prints_once() -> None:
    pytest.importorskip("torch.distributed.run")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "meshsim",
        "verify",
        "megatron",
        "--tp",
        "2",
        "--backend",
        "gloo",
    ]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASS: 25 kinds checked") == 1  # rank 0 only
    assert "megatron world_size=2" in result.stdout


@needs_unflatten
def test_sweep_real_leaves_out_the_lines_only_the_reference_models() -> None:
    """torchtitan's intermediate / legacy / hyper_parallel lines are not in the installed
    package: ``sweep --real`` builds the current line's layouts and says what it left out."""
    import io

    from rich.console import Console

    cases = meshsim.layouts(8, "torchtitan")
    printed = io.StringIO()
    kept = sweeping.real_cases(cases, Console(file=printed, width=400))
    assert kept and {c.config.get("version", "current") for c in kept} == {"current"}
    left = len(cases) - len(kept)
    assert left > 0
    text = printed.getvalue()
    for version in ("intermediate", "legacy", "hyper_parallel"):
        assert f"version={version!r} is modelled by meshsim's reference only" in text
    counts = [int(line.split()[4]) for line in text.splitlines() if "leaves out" in line]
    assert sum(counts) == left
