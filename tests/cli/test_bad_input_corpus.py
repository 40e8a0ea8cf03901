"""Every bad command line: exit 2, one line on stderr naming the cause, no traceback, before
any work (issue 28 item 5). In-process through ``main``: the same code path as the console
script at a fraction of the cost."""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
from pathlib import Path

import pytest

import meshsim
from meshsim import Layout
from meshsim.cli import outputs
from meshsim.cli.main import main
from meshsim.errors import LayoutError, MeshsimError, UsageError
from tests.cli.helpers import assert_bad_input

SHOW = ["show", "megatron", "-n", "8"]
TORCH = ["show", "torch", "-n", "4", "--mesh-shape", "2,2", "--mesh-dim-names", "dp,tp"]
SWEEP = ["sweep", "-n", "2", "--framework", "torch"]
DIFF = ["diff", "megatron", "megatron", "-n", "8"]
ORDER_X, ORDER_Y = "tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"
HUGE = str(2**40)

#: name -> (argv, words the one line must hold). ``{tmp}`` is a fresh directory.
CASES: dict[str, tuple[list[str], list[str]]] = {
    "no verb": ([], ["give a verb"]),
    "tp 0": ([*SHOW, "--tp", "0"], ["tensor_model_parallel_size", "got 0"]),
    "pp 0": ([*SHOW, "--pp", "0"], ["pipeline_model_parallel_size", "got 0"]),
    "tp not a number": ([*SHOW, "--tp", "1.5"], ["--tp", "'1.5'"]),
    "torch tp 0": (["show", "torch", "-n", "8", "--tp", "0"], ["--tp 0", ">= 1"]),
    "diff tp 0": ([*DIFF, "--tp", "0"], ["got 0"]),
    "world 2**40": (["show", "megatron", "-n", HUGE], ["limit of 4194304", HUGE]),
    "world 2**63": (["show", "torch", "-n", str(2**63)], ["limit of 4194304"]),
    "torch mesh 2**40": (
        ["show", "torch", "-n", HUGE, "--mesh-shape", HUGE, "--mesh-dim-names", "dp"],
        ["limit of 4194304"],
    ),
    "diff world 2**40": (
        ["diff", "megatron", f"megatron:order={ORDER_Y}", "-n", HUGE],
        ["limit of 4194304"],
    ),
    "verify world 2**40": (
        ["verify", "megatron", "-n", HUGE, "--backend", "fake"],
        ["exceeds the fake tier's maximum"],
    ),
    "sweep world 2**40": (["sweep", "-n", HUGE, "--framework", "torch"], ["limit of 4194304"]),
    "flag of another verb": ([*SHOW, "--backend", "gloo"], ["show takes no --backend"]),
    "order and --set order": (
        [*SHOW, "--order", ORDER_X, "--set", "order=tp-dp-pp"],
        [f"--order {ORDER_X}", "--set order=tp-dp-pp"],
    ),
    "native flag and --set": (
        [*SHOW, "--tensor-model-parallel-size", "2", "--set", "tensor_model_parallel_size=4"],
        ["--tensor-model-parallel-size 2", "--set tensor_model_parallel_size=4"],
    ),
    "mesh-shape and --set": (
        [*TORCH, "--set", "mesh_shape=4,1"],
        ["--mesh-shape 2,2", "--set mesh_shape=4,1"],
    ),
    "kinds and all-kinds": ([*SHOW, "--kinds", "tp", "--all-kinds"], ["--kinds", "--all-kinds"]),
    "empty kinds": ([*SHOW, "--kinds", ","], ["--kinds"]),
    "a-order and a-set": (
        [*DIFF, "--a-order", ORDER_X, "--a-set", f"order={ORDER_Y}"],
        [f"--a-set order={ORDER_Y}", f"--a-order {ORDER_X}"],
    ),
    "B spec and b-order": (
        ["diff", "megatron", f"megatron:order={ORDER_Y}", "-n", "8", "--b-order", ORDER_X],
        ["B's :order", f"--b-order {ORDER_X}"],
    ),
    "tp and --set in diff": (
        [*DIFF, "--tp", "2", "--set", "tensor_model_parallel_size=4"],
        ["--tp 2", "--set tensor_model_parallel_size=4"],
    ),
    "a-order on a framework without order": (
        ["diff", "torch", "megatron", "-n", "4", "--a-order", "tp-dp"],
        ["--a-order", "no order parameter"],
    ),
    "diff of one config with itself": (DIFF, ["same megatron config", "by construction"]),
    "cross-check and backend": (
        [*SWEEP, "--cross-check", "--backend", "fake"],
        ["--cross-check", "--backend"],
    ),
    "cross-check and communicate": (
        [*SWEEP, "--cross-check", "--communicate", "2"],
        ["--cross-check", "--communicate"],
    ),
    "svg under a png name": ([*TORCH, "--svg", "{tmp}/out.png"], ["--svg", "PNG", "*.svg"]),
    "png under an svg name": ([*TORCH, "--png", "{tmp}/out.svg"], ["--png", "*.png"]),
    "svg and png one file": (
        [*TORCH, "--svg", "{tmp}/pic", "--png", "{tmp}/pic"],
        ["--svg", "--png", "same file"],
    ),
    "json and junit one file": (
        [*SWEEP, "--json", "{tmp}/report", "--junit-xml", "{tmp}/report"],
        ["--json", "--junit-xml", "same file"],
    ),
    "empty output name": ([*TORCH, "--svg", ""], ["--svg takes a file name"]),
    "output in a missing folder": ([*SWEEP, "--json", "/proc/x/y.json"], ["does not exist"]),
    "output is a folder": ([*SWEEP, "--junit-xml", "{tmp}"], ["is a directory"]),
    "svg to a full device": ([*TORCH, "--svg", "/dev/full"], ["cannot write /dev/full"]),
    "env not a number": (
        ["verify", "megatron", "-n", "8", "--backend", "fake", "env:MESHSIM_MAX_WORLD_SIZE=abc"],
        ["MESHSIM_MAX_WORLD_SIZE", "'abc'"],
    ),
    "env pool size": (
        [*SHOW, "env:MESHSIM_POOL_SIZE=-1"],
        ["MESHSIM_POOL_SIZE must be >= 0"],
    ),
    "env torch release": ([*SHOW, "env:MESHSIM_TORCH_RELEASE=banana"], ["MESHSIM_TORCH_RELEASE"]),
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


@pytest.mark.parametrize("argv, needles", CASES.values(), ids=list(CASES))
def test_bad_input_is_one_line_before_any_work(
    argv: list[str],
    needles: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    words = []
    for word in argv:
        if word.startswith("env:"):
            name, _, value = word[4:].partition("=")
            monkeypatch.setenv(name, value)
        else:
            words.append(word.replace("{tmp}", str(tmp_path)))
    result = _run(words, capsys)
    assert_bad_input(result, *needles)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_real_megatron_on_fake_is_refused_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """megatron's own gloo groups cannot be made on the fake tier. Without megatron installed
    the missing install is the cause instead (test_verify_sweep's ..._names_the_extra)."""
    from meshsim.builders.real import unavailable

    if unavailable("megatron") is not None:
        pytest.skip("megatron is not installed: verify --real names the install instead")
    result = _run(["verify", "megatron", "-n", "8", "--real", "--backend", "fake"], capsys)
    assert_bad_input(result, "--real --backend fake", "create_gloo_process_groups")


def test_nccl_without_a_gpu_per_rank_is_refused_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from meshsim.harness.nccl import gpu_count

    if gpu_count() >= 8:
        pytest.skip("this machine has 8 GPUs")
    result = _run(["verify", "megatron", "-n", "8", "--backend", "nccl"], capsys)
    assert_bad_input(result, "needs 8 GPUs", f"has {gpu_count()}")


def test_a_full_stdout_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("sys.stdout", Full())
    result = _run([*TORCH, "--json"], capsys)
    assert_bad_input(result, "cannot write standard output", "No space left")


def test_repeated_kinds_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = [*SHOW, "--tp", "2", "--pp", "2", "--kinds", "tp", "--kinds", "pp,dp", "--json"]
    result = _run(argv, capsys)
    assert result.returncode == 0, result.stderr
    assert [k["name"] for k in json.loads(result.stdout)["kinds"]] == ["dp", "tp", "pp"]


def test_a_report_on_a_device_is_written_in_place_not_renamed_over_it() -> None:
    """``PATH.partial`` renamed over /dev/full once replaced the device with a regular file."""
    with pytest.raises(OSError) as info:
        outputs.write("/dev/full", lambda stream: stream.write("{}" * 10_000))
    assert info.value.errno == errno.ENOSPC and info.value.filename == "/dev/full"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_report_is_renamed_into_place_whole(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    outputs.write(str(target), lambda stream: stream.write("{}"))
    assert target.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_huge_world_lists_a_few_groups_per_kind(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    world = 1 << 17
    mesh = ["--mesh-shape", f"{world // 8},8", "--mesh-dim-names", "dp,tp"]
    result = _run(["show", "torch", "-n", str(world), *mesh, "--json"], capsys)
    assert result.returncode == 0, result.stderr
    tp = next(k for k in json.loads(result.stdout)["kinds"] if k["name"] == "tp")
    assert tp["num_groups"] == world // 8 and len(tp["groups"]) == 3
    assert tp["groups_complete"] is False and tp["groups"][1] == list(range(8, 16))


# -- the API: meshsim's own errors, never numpy's or Python's -------------------------------
API = {
    "Layout(5)": lambda: Layout(5),  # type: ignore[arg-type]
    "Layout('dp')": lambda: Layout("dp"),  # type: ignore[arg-type]
    "Layout(None)": lambda: Layout(None),  # type: ignore[arg-type]
    "Layout triple": lambda: Layout([("dp", 2, 3)]),  # type: ignore[list-item]
    "Layout int name": lambda: Layout({1: 2}),  # type: ignore[dict-item]
    "Layout float size": lambda: Layout(dp=2.0),  # type: ignore[arg-type]
    "Layout bool size": lambda: Layout(dp=True),
    "Layout negative size": lambda: Layout(dp=-1),
    "Layout 2**40": lambda: Layout(dp=2**40),
    "Layout 2**70": lambda: Layout(dp=2**35, tp=2**35),
    "from_order(5)": lambda: Layout.from_order(5, tp=2),  # type: ignore[arg-type]
    "from_topology dims int": lambda: Layout.from_topology(["a"], 2),  # type: ignore[arg-type]
    "from_mesh text": lambda: Layout.from_mesh("abc"),
    "from_mesh ragged": lambda: Layout.from_mesh([[0, 1], [2]]),
    "from_mesh floats": lambda: Layout.from_mesh([0.5, 1.5]),
    "from_mesh names length": lambda: Layout.from_mesh([[0, 1], [2, 3]], ["a"]),
    "group_of text": lambda: Layout(dp=2).group_of("x"),  # type: ignore[arg-type]
    "group_of float": lambda: Layout(dp=2).group_of(1.5),  # type: ignore[arg-type]
    "rank text": lambda: Layout(dp=2).rank(dp="x"),  # type: ignore[arg-type]
    "slice int": lambda: Layout(dp=2, tp=2)[5],  # type: ignore[index]
    "unflatten sizes int": lambda: Layout(dp=4).unflatten("dp", 4, ("a",)),  # type: ignore[arg-type]
    "flatten name int": lambda: Layout(dp=2, tp=2).flatten("dp", "tp", name=5),  # type: ignore[arg-type]
    "expect 2**40": lambda: meshsim.expect("megatron", 2**40),
    "expect float world": lambda: meshsim.expect("megatron", 8.0),  # type: ignore[arg-type]
    "expect bool degree": lambda: meshsim.expect("megatron", 8, tensor_model_parallel_size=True),
    "expect names length": lambda: meshsim.expect(
        "torch", 4, mesh_shape=(2, 2), mesh_dim_names=("a",)
    ),
    "assert_layout int": lambda: meshsim.assert_layout(5, meshsim.expect("torch", 2)),  # type: ignore[arg-type]
    "assert_layout strings": lambda: meshsim.assert_layout(["x"], meshsim.expect("torch", 2)),  # type: ignore[list-item]
    "assert_layout not Expected": lambda: meshsim.assert_layout([], "torch"),  # type: ignore[arg-type]
    "assert_layout kinds int": lambda: meshsim.assert_layout(
        [],
        meshsim.expect("torch", 2),
        kinds=5,  # type: ignore[arg-type]
    ),
}


@pytest.mark.parametrize("call", API.values(), ids=list(API))
def test_api_bad_arguments_raise_meshsim_errors(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MeshsimError) as info:
        call()
    assert isinstance(info.value, (LayoutError, UsageError))
    assert "\n" not in str(info.value)


def test_assert_layout_takes_one_kind_as_a_string() -> None:
    """``kinds="tp"`` is one kind, not the kinds 't' and 'p'."""
    from meshsim.checks.assertions import _check_arguments

    assert _check_arguments([], meshsim.expect("megatron", 8), "tp") == ([], ["tp"])
