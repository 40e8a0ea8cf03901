"""``meshsim verify FRAMEWORK ... --equivalence`` as a user runs it."""

from __future__ import annotations

import pytest

from tests.cli.helpers import assert_bad_input, json_of, run_cli


def test_equivalence_flag_compares_the_recipe_with_its_serial_twin() -> None:
    result = run_cli(
        "verify", "olmo-core", "-n", "8", "--backend", "threaded",
        "--set", "dp=hsdp", "--set", "cp=2", "--equivalence", "--json", timeout=300,
    )  # fmt: skip
    report = json_of(result)
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["passed"] and report["equivalence"]["passed"]
    assert report["equivalence"]["error"] is None
    assert "tensors over 2 steps" in report["equivalence"]["summary"]


def test_a_framework_finding_exits_1_with_the_first_line() -> None:
    result = run_cli(
        "verify", "verl", "-n", "8", "--backend", "threaded", "--set", "fsdp_size=1",
        "--equivalence", timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "equivalence" in result.stdout and "FAIL" in result.stdout
    assert "grad of `stage0.0.weight` at step 1 on ranks 0-7" in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("olmo-core", "--backend", "fake", "--set", "dp=fsdp"), "fake backend moves no data"),
        (("megatron", "--backend", "threaded"), "recipe for olmo-core, torchtitan"),
    ],
)
def test_equivalence_refusals_are_bad_input(args: tuple[str, ...], needle: str) -> None:
    assert_bad_input(run_cli("verify", *args, "-n", "8", "--equivalence"), needle)


def test_real_reaches_every_framework_with_an_own_step_and_only_those() -> None:
    """``--real`` lets ``--equivalence`` through for a framework meshsim runs the own step of,
    though meshsim's recipe has none for it (DeepSpeed, megatron); without ``--real`` the
    recipe's list still decides, and the fake tier is refused either way."""
    import argparse

    from meshsim.cli import equivalence
    from meshsim.errors import UsageError
    from meshsim.own_steps import STEPS

    def args(framework: str, real: bool, backend: str = "gloo") -> argparse.Namespace:
        return argparse.Namespace(framework=framework, real=real, backend=backend)

    for framework in STEPS:
        equivalence.check_args(args(framework, real=True))
        with pytest.raises(UsageError, match="fake backend moves no data"):
            equivalence.check_args(args(framework, real=True, backend="fake"))
    with pytest.raises(UsageError, match=r"has a recipe for .* not 'deepspeed'"):
        equivalence.check_args(args("deepspeed", real=False))
    with pytest.raises(UsageError, match=r"has a recipe for .* not 'areal'"):
        equivalence.check_args(args("areal", real=True))


def test_an_own_step_is_not_called_hung_before_its_least_timeout() -> None:
    """The own steps train real models on every rank (minutes at world 8 on two cores): the
    group checks' 120 s default timed slow work out as a failure. They wait at least 900 s;
    a longer --timeout is kept, and meshsim's recipe keeps --timeout as given."""
    from meshsim.cli.equivalence import OWN_STEP_TIMEOUT_S, step_timeout

    assert step_timeout(120.0, True, "torchtitan") == OWN_STEP_TIMEOUT_S == 900.0
    assert step_timeout(1800.0, True, "megatron") == 1800.0
    assert step_timeout(120.0, False, "torchtitan") == 120.0
    assert step_timeout(120.0, True, "areal") == 120.0
