"""Bad input on the command line: one line on stderr, exit 2, before any work starts.

A sweep takes minutes; an output path with a typo or a backend the machine lacks must be
refused at once, not after the work (or with a traceback).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import run_cli

MESH = ("--mesh-shape", "2,2", "--mesh-dim-names", "dp,tp")


def _one_line_refusal(result, *words: str) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshsim: error:"), result.stderr
    for word in words:
        assert word in last, last
    return last


@pytest.mark.parametrize("flag", ["--svg", "--png"])
def test_show_refuses_a_picture_path_in_a_missing_directory(flag: str, tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "mesh.out"
    result = run_cli("show", "torch", "-n", "4", *MESH, flag, str(target))
    _one_line_refusal(result, flag, "does not exist")


def test_sweep_refuses_report_paths_before_it_starts(tmp_path: Path) -> None:
    for flag, path in (("--json", tmp_path / "x" / "r.json"), ("--junit-xml", tmp_path)):
        result = run_cli("sweep", "-n", "2", "--framework", "torch", flag, str(path))
        _one_line_refusal(result, flag)
        assert "layouts" not in result.stderr  # refused before the first progress line


def test_nccl_without_enough_gpus_is_one_line() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    result = run_cli("sweep", "-n", "2", "--framework", "torch", "--backend", "nccl")
    _one_line_refusal(result, "needs 2 GPUs")


def test_diff_with_nothing_shared_is_not_a_pass() -> None:
    result = run_cli("diff", "torch", "olmo-core", "-n", "4")
    _one_line_refusal(result, "share no role or kind", "nothing was compared")


def test_a_one_dim_mesh_shape_is_a_tuple_of_one() -> None:
    result = run_cli("show", "torch", "-n", "4", "--mesh-shape", "4", "--mesh-dim-names", "dp")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dp" in result.stdout


def test_a_scalar_mesh_shape_in_the_api_is_refused_as_torch_refuses_it() -> None:
    from meshsim import expect
    from meshsim.errors import LayoutError

    with pytest.raises(LayoutError, match="mesh_shape must be a tuple") as info:
        expect("torch", 4, mesh_shape=4)
    assert info.value.upstream == "TypeError"  # init_device_mesh("cpu", 4): TypeError


def test_list_keeps_the_brackets_of_kind_names() -> None:
    """rich read ``[tp]`` as markup: 15 rows all said ``hyper_comm_grid``."""
    result = run_cli("list", "megatron")
    assert result.returncode == 0, result.stderr
    assert "hyper_comm_grid[tp]" in result.stdout
    names = [line.split("│")[1].strip() for line in result.stdout.splitlines() if "│ hyper" in line]
    kinds = [n for n in names if n.startswith("hyper_comm_grid[")]
    assert len(kinds) == len(set(kinds)) > 1


def test_a_shared_degree_and_the_native_flag_must_agree() -> None:
    both = ("show", "megatron", "-n", "8", "--tp", "2", "--tensor-model-parallel-size")
    _one_line_refusal(run_cli(*both, "4"), "--tp 2", "--tensor-model-parallel-size 4")
    same = run_cli(*both, "2")
    assert same.returncode == 0, same.stderr
