"""``meshsim sweep --equivalence``: each layout whose groups pass trains against its serial twin.

Real ranks, real steps: meshsim's recipe on threaded ranks here (the framework's own step,
``--real``, is covered for torchtitan in tests/real/test_torchtitan_own_step.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import meshsim
from meshsim.cli import sweep_equivalence
from meshsim.cli.sweep_report import Outcome, Report
from meshsim.verify import verify_case
from tests.cli.helpers import assert_bad_input, run_cli
from tests.cli.json_schema import errors
from tests.cli.test_json_schemas import schema


def test_every_layout_trains_or_says_why_not(tmp_path: Path) -> None:
    """Every OLMo-core layout at world 2 trains or is refused with a reason; those with a
    data-parallel config match their twin, those without fail it: OLMo applies no DDP/FSDP
    then, while its loader still splits the batch (a finding, docs/findings.md)."""
    out = tmp_path / "sweep.json"
    done = run_cli(
        "sweep", "-n", "2", "--framework", "olmo-core", "--backend", "threaded",
        "--equivalence", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert errors(data, schema("sweep")) == []
    results = [r for r in data["results"] if r["equivalence"] is not None]
    assert len(results) == len(data["results"])
    ran = [r for r in results if r["equivalence"]["ran"]]
    refused = [r["equivalence"] for r in results if not r["equivalence"]["ran"]]
    assert ran and all(r["equivalence"]["step"] == "meshsim's recipe" for r in ran)
    assert all(s["refused"] and s["passed"] is None for s in refused)
    failed = [r for r in ran if not r["equivalence"]["passed"]]
    assert failed and all("dp" not in r["config"] for r in failed), failed
    assert all("not averaged over" in r["equivalence"]["error"] for r in failed)
    matched = len(ran) - len(failed)
    assert matched and all("dp" in r["config"] for r in ran if r["equivalence"]["passed"])
    assert (
        f"equivalence: {len(ran)} layouts trained, {matched} match their serial twin, "
        f"{len(failed)} do not" in done.stdout + done.stderr
    )


def test_a_step_that_differs_from_its_twin_fails_the_sweep() -> None:
    """accelerate 1.15 skips DDP under tensor parallelism while its loader still splits the
    batch over two replicas (a finding, pinned in tests/usage): the groups pass, the step does
    not, and the layout fails with the step's first line."""
    config = {"dp_shard_size": 2, "tp_size": 4, "distributed_type": "MULTI_GPU"}
    (case,) = [c for c in meshsim.layouts(8, "accelerate") if dict(c.config) == config]
    outcome = Outcome(case)
    outcome.results["threaded"] = verify_case(case, "threaded")
    assert outcome.passed

    class Quiet:
        def start(self, *args: object) -> None: ...
        def advance(self, *args: object) -> None: ...
        def finish(self, *args: object) -> None: ...

    args = _args(backend="threaded")
    assert sweep_equivalence.run(args, [outcome], Quiet(), lambda: False)
    assert not outcome.passed
    assert "[equivalence] " in outcome.message()
    assert "no collective reduced it on this rank" in outcome.message()
    report = Report(8, ["threaded"], [outcome], 1, 1.0)
    assert report.exit_code == 1


def test_a_layout_refused_up_front_is_not_counted_in_the_progress() -> None:
    """The sweep asks each layout's refusal before any rank runs, so its progress line and
    time estimate count only layouts that train; the refused one keeps its reason."""
    config = {"dp": "ddp", "tp": 2}
    (case,) = [c for c in meshsim.layouts(8, "olmo-core") if dict(c.config) == config]
    outcome = Outcome(case)
    outcome.results["fake"] = verify_case(case, "fake")
    assert outcome.passed
    started: list[tuple[str, int]] = []

    class Counting:
        def start(self, label: str, total: int) -> None:
            started.append((label, total))

        def advance(self, *args: object) -> None:
            raise AssertionError("nothing should train")

        def finish(self, *args: object) -> None: ...

    assert sweep_equivalence.run(_args(backend="fake"), [outcome], Counting(), lambda: False)
    assert started == [("equivalence (threaded)", 0)]
    assert "DDP over a tensor-parallel model" in (outcome.step.refused or ""), outcome.step
    assert outcome.passed


def test_the_reference_backend_cannot_train() -> None:
    done = run_cli("sweep", "-n", "2", "--backend", "reference", "--equivalence")
    assert_bad_input(done, "--equivalence trains each layout on live ranks")


def _args(**values: object) -> object:
    import argparse

    defaults = {"real": False, "timeout": 120.0, "fail_fast": False, "equivalence": True}
    return argparse.Namespace(**{**defaults, **values})
