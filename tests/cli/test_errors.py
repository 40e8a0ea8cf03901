"""Bad input: the framework's own rule in one line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from meshsim.cli.main import main
from tests.cli.helpers import assert_bad_input, run_cli

CASES = {
    "unknown framework": (
        ["show", "megatrn", "-n", "8"],
        ["unknown framework 'megatrn'", "did you mean 'megatron'"],
    ),
    "unknown flag": (
        ["show", "megatron", "-n", "8", "--tensor-parallel-size", "2"],
        ["--tensor-parallel-size", "did you mean --tensor-model-parallel-size"],
    ),
    "degrees do not divide the world": (
        ["show", "megatron", "-n", "8", "--tp", "3"],
        ["world_size 8 is not divisible", "3×1×1 = 3"],
    ),
    "tp with ep in olmo-core": (
        ["show", "olmo-core", "-n", "8", "--dp", "hsdp", "--tp", "2", "--ep", "2"],
        ["expert parallelism is mutually exclusive with tensor"],
    ),
    "olmo-core needs a dp config": (
        ["show", "olmo-core", "-n", "8", "--tp", "2"],
        ["Data parallel config is required"],
    ),
    "megatron order needs pp last": (
        [
            "show",
            "megatron",
            "-n",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--cp",
            "2",
            "--order",
            "tp-cp-pp-ep-dp",
        ],
        ["does not end with 'pp'", "dense dp = 2 and expert dp = 4"],
    ),
    "unknown config key": (
        ["show", "megatron", "-n", "8", "--set", "foo=1"],
        ["megatron takes no config key(s) ['foo']"],
    ),
    "malformed --set": (["show", "megatron", "-n", "8", "--set", "tp"], ["key=value", "'tp'"]),
    "missing world size": (["show", "megatron"], ["--world-size"]),
    "world size not a number": (["show", "megatron", "-n", "x"], ["--world-size", "'x'"]),
    "flag without value": (["show", "megatron", "-n", "8", "--tp"], ["--tp"]),
    "unknown verb": (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    "dp that does not fit": (
        ["show", "megatron", "-n", "16", "--tp", "2", "--dp", "4"],
        ["dp = 4 does not fit world size 16", "dp must be 8"],
    ),
    "diff with unknown framework": (
        ["diff", "megatron", "bogus:order=x", "-n", "8"],
        ["unknown framework 'bogus'"],
    ),
    "diff side with bad order": (
        ["diff", "megatron", "megatron:order=tp-dp-xx", "-n", "8"],
        ["xx"],
    ),
    "diff degree a side lacks": (
        ["diff", "megatron", "torch", "-n", "8", "--ep", "2"],
        ["torch convention has no ep"],
    ),
    "sweep with unknown framework": (
        ["sweep", "-n", "4", "--framework", "nope"],
        ["unknown framework 'nope'"],
    ),
    "verify bad config fails before any rank runs": (
        ["verify", "megatron", "-n", "8", "--tp", "3", "--backend", "fake"],
        ["world_size 8 is not divisible"],
    ),
}


#: Run as a real subprocess too (the rest run in-process: same code path, a tenth of the time).
SUBPROCESS = (
    "unknown framework",
    "unknown flag",
    "degrees do not divide the world",
    "tp with ep in olmo-core",
    "diff with unknown framework",
)


@pytest.mark.parametrize("args, needles", [CASES[k] for k in SUBPROCESS], ids=SUBPROCESS)
def test_bad_input_is_one_line_exit_2(args: list[str], needles: list[str]) -> None:
    assert_bad_input(run_cli(*args), *needles)


@pytest.mark.parametrize("args, needles", CASES.values(), ids=list(CASES))
def test_bad_input_in_process(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    result = subprocess.CompletedProcess(args, exit_info.value.code, captured.out, captured.err)
    assert_bad_input(result, *needles)


def test_help_lists_the_framework_flags() -> None:
    result = run_cli("show", "megatron", "--help")
    assert result.returncode == 0
    assert "--tensor-model-parallel-size" in result.stdout
    assert "--tp N" in result.stdout and "tensor_model_parallel_size" in result.stdout
    result = run_cli("show", "deepspeed", "--help")
    assert "--num-mp" in result.stdout and "--use-data-before-expert-parallel " in result.stdout


def test_a_zoom_wider_than_a_rank_picture_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A huge world draws a node-level picture; the rank-level window is what has a limit."""
    target = tmp_path / "x.svg"
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["show", "megatron", "-n", "8192", "--tp", "8", "--svg", str(target), "--zoom", "0:512"]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "holds 512 ranks" in err and "--zoom 0:256" in err
    assert not target.exists()
