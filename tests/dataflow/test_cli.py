"""``meshsim verify FRAMEWORK ... --dataflow`` as a user runs it."""

from __future__ import annotations

import pytest

from tests.cli.helpers import assert_bad_input, json_of, run_cli
from tests.releases import needs_unflatten


@needs_unflatten
def test_dataflow_flag_runs_the_recipe_after_the_group_check() -> None:
    result = run_cli(
        "verify", "torchtitan", "-n", "8", "--backend", "threaded",
        "--dp-shard", "2", "--cp", "2", "--tp", "2", "--dataflow", "--json", timeout=300,
    )  # fmt: skip
    report = json_of(result)
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["passed"] and report["dataflow"]["passed"]
    assert report["dataflow"]["wiring"] == "correct"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("olmo-core", "--backend", "fake", "--set", "dp=fsdp"), "fake backend moves no data"),
        (("megatron", "--backend", "threaded"), "recipe for olmo-core, torchtitan"),
        (
            # pipeline-only layouts train (6b6a2fd); pp with tp no released Trainer runs
            ("transformers", "--backend", "threaded", "--pp-size", "2", "--tp-size", "4"),
            "no Trainer runs this layout",
        ),
    ],
)
def test_dataflow_refusals_are_bad_input(args: tuple[str, ...], needle: str) -> None:
    assert_bad_input(run_cli("verify", *args, "-n", "8", "--dataflow"), needle)
