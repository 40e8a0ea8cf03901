"""sweep at scale: the reference step, one live proof per distinct group structure, the builds
of the layouts that repeat one (still run, on three fake ranks, and still able to fail),
``--backend reference``, ``--sample`` and ``--budget``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import meshsim
from meshsim.cli import sweep as sweeping
from meshsim.cli.main import main
from meshsim.cli.sweep_remote import REFERENCE, Chunk, examine
from meshsim.model.fingerprint import group_fingerprint
from tests.cli.helpers import run_cli
from tests.cli.json_schema import errors
from tests.cli.test_json_schemas import schema


class InProcess:
    """The sweep's workers, answering in this process (so a test can plant a builder bug)."""

    def __init__(self, jobs: int) -> None:
        pass

    def run(self, chunks: Any, stop: Any, *, parallel: bool, tick: Any = None) -> Iterator[Any]:
        for number, chunk in enumerate(chunks):
            for index, answer in examine(chunk):
                yield number, index, answer

    def close(self, stop: Any) -> None:
        pass

    def kill(self) -> None:
        pass


def test_same_groups_under_other_names_share_a_fingerprint() -> None:
    tp = meshsim.expect("torch", 8, mesh_shape=(4, 2), mesh_dim_names=("dp", "tp"))
    cp = meshsim.expect("torch", 8, mesh_shape=(4, 2), mesh_dim_names=("dp", "cp"))
    other = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    assert group_fingerprint(tp) == group_fingerprint(cp) != group_fingerprint(other)
    # A megatron order that only moves degree-1 dims builds the very same groups.
    a = meshsim.expect("megatron", 8, tensor_model_parallel_size=2, order="tp-cp-ep-dp-pp")
    b = meshsim.expect("megatron", 8, tensor_model_parallel_size=2, order="tp-ep-cp-dp-pp")
    assert group_fingerprint(a) == group_fingerprint(b)
    # Moving dims of degree 2 changes the groups, and the fingerprint.
    pp = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    c = meshsim.expect("megatron", 8, **pp, order="tp-cp-ep-dp-pp")
    d = meshsim.expect("megatron", 8, **pp, order="tp-cp-ep-pp-dp")
    assert group_fingerprint(c) != group_fingerprint(d)


def test_a_bug_in_a_layout_that_repeats_a_structure_still_fails_the_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worst defect a faster sweep could have: passing a builder that is wrong for one
    spelling of a layout because another spelling proved the same groups. The layout that
    repeats a structure is built by its own code on three ranks and diffed against its own
    reference, so a bug on that code path alone fails it, named."""
    from meshsim.builders import megatron as builder

    cases = meshsim.layouts(8, "megatron")
    prints = [group_fingerprint(c.expect()) for c in cases]
    first = {}
    victim = next(c for c, p in zip(cases, prints) if first.setdefault(p, c) is not c)
    original = builder.build

    def build(world_size: int, config: dict[str, Any]) -> Any:
        if config == dict(victim.config):  # the bug: this spelling gets another tp degree
            tp = config.get("tensor_model_parallel_size", 1)
            config = {**config, "tensor_model_parallel_size": 1 if tp > 1 else 2}
        return original(world_size, config)

    monkeypatch.setattr(builder, "build", build)
    monkeypatch.setattr(sweeping, "Workers", InProcess)
    out = tmp_path / "sweep.json"
    code = main(["sweep", "-n", "8", "--framework", "megatron", "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    assert errors(data, schema("sweep")) == []
    failed = [r for r in data["results"] if not r["passed"]]
    assert [r["id"] for r in failed] == [victim.id]
    assert failed[0]["shares_groups_with"] == first[group_fingerprint(victim.expect())].id
    assert failed[0]["tiers"]["fake"]["ranks"] == [0, 4, 7]
    assert data["distinct_group_structures"] == len(set(prints))
    assert f"FAIL {victim.id}" in capsys.readouterr().out


def test_every_layout_is_built_and_each_structure_on_every_rank() -> None:
    result = run_cli("sweep", "-n", "8", "--framework", "megatron-deepspeed", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert errors(data, schema("sweep")) == []
    results = data["results"]
    assert data["layouts_built"] == len(results) == data["layouts_total"]
    full = [r for r in results if r["shares_groups_with"] is None]
    shared = [r for r in results if r["shares_groups_with"] is not None]
    assert len(full) == data["distinct_group_structures"] and shared
    assert all(r["tiers"]["fake"]["ranks"] is None for r in full)
    assert all(r["tiers"]["fake"]["ranks"] == [0, 4, 7] for r in shared)
    by_id = {r["id"]: r for r in results}
    for r in shared:
        assert by_id[r["shares_groups_with"]]["fingerprint"] == r["fingerprint"]
    assert "distinct group structures" in result.stderr
    # --exhaustive: every layout on every rank.
    whole = json.loads(
        run_cli(
            "sweep", "-n", "8", "--framework", "megatron-deepspeed", "--exhaustive", "--json"
        ).stdout
    )
    assert all(r["tiers"]["fake"]["ranks"] is None for r in whole["results"])
    assert all(r["shares_groups_with"] is None for r in whole["results"])


def test_reference_backend_examines_every_layout_without_a_live_rank() -> None:
    result = run_cli("sweep", "-n", "512", "--framework", "deepspeed", "--json")
    assert result.returncode == 0, result.stderr
    assert "above 256 ranks: the reference examines every layout" in result.stderr
    data = json.loads(result.stdout)
    assert errors(data, schema("sweep")) == []
    assert data["tiers"] == [REFERENCE] and data["complete"] is True
    assert data["layouts_done"] == data["layouts_total"] == len(data["results"]) > 10
    assert {r["tiers"]["reference"]["backend"] for r in data["results"]} == {REFERENCE}
    assert all(r["fingerprint"] for r in data["results"])


def test_reference_chunks_never_import_torch() -> None:
    """The reference step is what makes a million-layout sweep possible: no torch, no rank."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from meshsim.cli.sweep_remote import Chunk, examine\n"
        "from meshsim.model.sweep import layouts\n"
        "answers = list(examine(Chunk(layouts(64, 'megatron')[:20], 'reference', 60.0)))\n"
        "assert len(answers) == 20 and all(a.fingerprint for _, a in answers)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert isinstance(Chunk([], REFERENCE, 1.0).tier, str)


def test_sample_builds_n_distinct_structures_and_the_reference_examines_the_rest() -> None:
    result = run_cli("sweep", "-n", "8", "--framework", "deepspeed", "--sample", "3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert errors(data, schema("sweep")) == []
    built = [r for r in data["results"] if r["built"]]
    assert len(built) == data["layouts_built"] == 3
    assert data["layouts_done"] == data["layouts_total"] == len(data["results"])
    assert data["complete"] is True and data["exit_code"] == 0


def test_budget_stops_live_builds_and_reports_what_was_built() -> None:
    """A budget too small for any build: the reference still examines everything, the live
    step stops at once, and the reports say so (exit 0: nothing built failed)."""
    result = run_cli("sweep", "-n", "16", "--framework", "megatron", "--budget", "0.001", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert errors(data, schema("sweep")) == []
    assert data["budget_spent"] is True and data["complete"] is False
    assert data["layouts_done"] == data["layouts_total"] == len(data["results"])
    assert data["layouts_built"] < data["layouts_total"]
    assert "stopped (budget spent)" in result.stderr
    assert "examined by the reference only (--budget ran out)" in result.stderr


@pytest.mark.parametrize("flag", [["--communicate", "2"], ["--sample", "2"], ["--real"]])
def test_reference_backend_refuses_flags_that_ask_for_live_builds(flag: list[str]) -> None:
    result = run_cli("sweep", "-n", "8", "--backend", "reference", *flag)
    assert result.returncode == 2
    assert "--backend reference builds no live layout" in result.stderr
    assert flag[0] in result.stderr


def test_progress_lines_come_while_no_answer_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line at least every PROGRESS_EVERY seconds while a step runs, answers or not."""
    from rich.console import Console

    clock = [100.0]
    monkeypatch.setattr(sweeping.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    monkeypatch.setattr(sweeping, "print", lambda *a, **k: lines.append(a[0]), raising=False)
    progress = sweeping._Progress(Console(force_terminal=False), 0.0)
    progress.start("fake", 10)
    assert len(lines) == 1
    progress.tick()
    clock[0] += sweeping.PROGRESS_EVERY
    progress.tick()  # no answer yet, but the interval passed
    assert len(lines) == 2 and "fake 0/10 layouts" in lines[1]
    progress.advance("fake", True)
    clock[0] += sweeping.PROGRESS_EVERY
    progress.tick()
    assert "fake 1/10 layouts" in lines[-1] and "left" in lines[-1]
