"""``meshsim show``: tables, rank grids, JSON, node crossings and pictures, end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.cli.helpers import ROOT, assert_bad_input, json_of, run_cli

MEGATRON_16 = (
    "megatron",
    "--world-size",
    "16",
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "4",
)
SVG = "{http://www.w3.org/2000/svg}"


def test_table_lists_every_kind_with_role_and_first_groups() -> None:
    result = run_cli("show", *MEGATRON_16)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for kind in ("dp-cp", "tp-pp", "embedding", "expert:tp-ep-pp"):
        assert f"│ {kind} " in out
    tp_row = next(line for line in out.splitlines() if line.startswith("│ tp "))
    assert "[(0, 1), (2, 3), (4, 5), ... 5 more]" in tp_row and "tensor" in tp_row
    pp_row = next(line for line in out.splitlines() if line.startswith("│ pp "))
    assert "(0, 4, 8, 12)" in pp_row and "pipeline" in pp_row


def test_grid_labels_each_rank_with_its_group() -> None:
    out = run_cli("show", *MEGATRON_16).stdout
    lines = out.splitlines()
    at = lines.index("tp [tensor]: 8 groups of 2")
    # rows of 8 ranks; cell = group id: ranks 0,1 in group 0, ranks 8,9 in group 4
    assert lines[at + 2].split() == ["0", "0", "0", "1", "1", "2", "2", "3", "3"]
    assert lines[at + 3].split() == ["8", "4", "4", "5", "5", "6", "6", "7", "7"]
    at = lines.index("pp [pipeline]: 4 groups of 4")
    assert lines[at + 2].split() == ["0", "0", "1", "2", "3", "0", "1", "2", "3"]
    assert "dp [data_parallel]: same groups as dp-cp" in out  # repeats are not redrawn
    embedding = lines[lines.index("embedding [embedding]: 4 groups of 2") + 2]
    assert embedding.split()[-4:] == ["·"] * 4  # middle stages hold no embedding group


def test_json_is_machine_readable_and_complete() -> None:
    data = json_of(run_cli("show", *MEGATRON_16, "--json", "--all-groups"))
    assert data["all_groups"] is True
    assert data["framework"] == "megatron" and data["world_size"] == 16
    assert data["config"]["order"] == "tp-cp-ep-dp-pp"
    kinds = {k["name"]: k for k in data["kinds"]}
    assert kinds["tp"]["groups"] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert kinds["dp"]["roles"] == ["data_parallel"]
    assert kinds["pp"]["num_groups"] == 4 and kinds["pp"]["group_size"] == 4
    assert data["roles"]["gradient_reduce"] == "dp-cp"
    # megatron-core 0.16.1 makes the independent all-gather group only when asked
    assert list(data["unavailable"]) == ["dp-cp:ag"]
    assert data["unavailable"]["dp-cp:ag"]["upstream"] == "AssertionError"


def test_unavailable_kinds_are_listed_with_the_framework_error() -> None:
    args = ("show", "olmo-core", "-n", "8", "--dp", "hsdp", "--num-replicas", "2", "--cp", "2")
    out = run_cli(*args, "--no-grid").stdout
    assert "unavailable" in out
    line = next(line for line in out.splitlines() if "get_dp_shard_mesh:" in line)
    assert "could not determine" in line
    data = json_of(run_cli(*args, "--json"))
    assert "get_dp_shard_mesh" in data["unavailable"]
    assert "could not determine" in data["unavailable"]["get_dp_shard_mesh"]["error"]


def test_gpus_per_node_marks_groups_that_cross_nodes() -> None:
    data = json_of(run_cli("show", *MEGATRON_16, "--gpus-per-node", "4", "--json"))
    crossing = {k["name"]: k["groups_crossing_nodes"] for k in data["kinds"]}
    assert crossing["tp"] == 0  # tp pairs sit inside 4-GPU nodes
    assert crossing["pp"] == 4  # every pipeline spans 4 nodes
    out = run_cli("show", *MEGATRON_16, "--gpus-per-node", "4", "--kinds", "pipeline").stdout
    assert "pp [pipeline]: 4 groups of 4, 4 cross nodes" in out
    assert "cross nodes" in out
    assert "n3" in out  # grid rows are nodes


def test_flag_spellings_give_the_same_config() -> None:
    native = json_of(run_cli("show", *MEGATRON_16, "--json"))
    short = json_of(run_cli("show", "megatron", "-n", "16", "--tp", "2", "--pp", "4", "--json"))
    generic = json_of(
        run_cli(
            "show",
            "megatron",
            "-n",
            "16",
            "--set",
            "tensor_model_parallel_size=2",
            "--set",
            "pipeline-model-parallel-size=4",
            "--json",
        )
    )
    assert native == short == generic


def test_torch_takes_shared_degrees_as_a_mesh() -> None:
    data = json_of(run_cli("show", "torch", "-n", "8", "--tp", "2", "--cp", "2", "--json"))
    assert data["config"]["mesh_shape"] == [1, 2, 2, 2]
    kinds = {k["name"]: k["groups"] for k in data["kinds"]}
    assert kinds["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _svg_panels(path: Path) -> list[ET.Element]:
    root = ET.parse(path).getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg"
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"]


def test_svg_has_one_panel_per_kind(tmp_path: Path) -> None:
    target = tmp_path / "layout.svg"
    result = run_cli("show", *MEGATRON_16, "--svg", str(target), "--json")
    kinds = [k["name"] for k in json_of(result)["kinds"]]
    assert target.exists() and 10_000 < target.stat().st_size < 2_000_000
    panels = _svg_panels(target)
    assert [p.get("data-kind") for p in panels] == kinds
    for panel in panels:  # one cell per rank in every panel
        cells = [r for r in panel.iter(f"{SVG}rect") if r.get("width") == r.get("height")]
        assert len(cells) == 16


def test_svg_stays_readable_at_world_64(tmp_path: Path) -> None:
    target = tmp_path / "w64.svg"
    result = run_cli(
        "show",
        "megatron",
        "-n",
        "64",
        "--tp",
        "4",
        "--pp",
        "2",
        "--cp",
        "2",
        "--gpus-per-node",
        "8",
        "--svg",
        str(target),
        "--no-grid",
    )
    assert result.returncode == 0, result.stderr
    panels = _svg_panels(target)
    assert len(panels) == 24  # 0.16.1: 3 partial dist-opt groups and 5 gloo twins too
    texts = [t for t in panels[0].iter(f"{SVG}text")]
    assert {t.text for t in texts} >= {str(r) for r in range(64)} | {"node 7"}
    assert min(float(t.get("font-size", 0)) for t in texts) >= 6.5  # legible labels
    width = float(ET.parse(target).getroot().get("width", 0))
    assert width <= 1600


def test_unavailable_kinds_go_to_the_svg_footer_not_a_panel(tmp_path: Path) -> None:
    target = tmp_path / "olmo.svg"
    result = run_cli(
        "show",
        "olmo-core",
        "-n",
        "8",
        "--dp",
        "hsdp",
        "--num-replicas",
        "2",
        "--cp",
        "2",
        "--svg",
        str(target),
        "--json",
    )
    data = json_of(result)
    panels = _svg_panels(target)
    assert len(panels) == len(data["kinds"])
    assert "get_dp_shard_mesh" not in {p.get("data-kind") for p in panels}
    assert "unavailable get_dp_shard_mesh" in target.read_text()


def test_png_without_matplotlib_says_which_extra_to_install(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('blocked')\n")
    result = run_cli(
        "show",
        *MEGATRON_16,
        "--png",
        str(tmp_path / "x.png"),
        env={"PYTHONPATH": f"{blocker}:{ROOT}"},
    )
    assert_bad_input(result, "pip install 'meshsim[plot]'")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs meshsim[plot]")
def test_png_with_matplotlib(tmp_path: Path) -> None:
    target = tmp_path / "layout.png"
    result = run_cli("show", *MEGATRON_16, "--png", str(target), "--no-grid")
    assert result.returncode == 0, result.stderr
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_never_imports_torch(tmp_path: Path) -> None:
    svg = str(tmp_path / "a.svg")
    code = (
        "import sys\n"
        "from meshsim.cli.main import main\n"
        f"rc = main(['show', 'megatron', '-n', '16', '--tp', '2', '--svg', {svg!r}])\n"
        "rc += main(['diff', 'megatron', 'megatron:order=tp-cp-pp-ep-dp', '-n', '8',"
        " '--pp', '2'])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.stdout.splitlines()[-1] == "NO-TORCH 1", result.stderr


def test_json_gives_each_kind_its_structure_and_a_sample() -> None:
    """By default a kind is its sizes and strides, a formula and its first groups; the
    structure alone rebuilds what --all-groups lists."""
    args = ("show", "megatron", "-n", "64", "--tp", "2", "--pp", "2", "--cp", "2", "--json")
    summary = json_of(run_cli(*args))
    full = json_of(run_cli(*args, "--all-groups"))
    assert summary["all_groups"] is False and full["all_groups"] is True
    listed = {k["name"]: k for k in full["kinds"]}
    for kind in summary["kinds"]:
        name, structure = kind["name"], kind["structure"]
        assert structure is not None, name
        assert len(kind["groups"]) == min(3, kind["num_groups"]), name
        assert kind["groups_complete"] is (kind["num_groups"] <= 3), name
        assert kind["groups"] == listed[name]["groups"][: len(kind["groups"])], name
        assert _rebuilt(structure) == sorted(listed[name]["groups"]), name
        assert structure == listed[name]["structure"], name
    tp = next(k for k in summary["kinds"] if k["name"] == "tp")
    assert tp["structure"]["formula"] == "ranks r + i (i < 2) for r = 2a (a < 32)"


def _rebuilt(structure: dict[str, Any]) -> list[list[int]]:
    """Every group, from the structure's numbers only, as a JSON reader would rebuild them."""

    def ranks(first: int, sizes: list[int], strides: list[int]) -> list[int]:
        out = [first]
        for size, stride in zip(sizes, strides):
            out = [base + c * stride for base in out for c in range(size)]
        return out

    members = ranks(0, structure["members"]["sizes"], structure["members"]["strides"])
    starts = ranks(**structure["starts"])
    return sorted([start + m for m in members] for start in starts)


def test_json_of_a_huge_world_stays_small() -> None:
    """131,072 ranks: 55 MB of JSON when every group was listed; a sample holds at most 1,024
    ranks a kind, so one group of every rank is left to the formula."""
    result = run_cli("show", "megatron", "-n", str(1 << 17), "--tp", "8", "--json")
    data = json_of(result)
    assert len(result.stdout) < 300_000
    dp = next(k for k in data["kinds"] if k["name"] == "dp")
    assert dp["group_size"] == 1 << 14 and dp["groups"] == [] and not dp["groups_complete"]
    assert dp["structure"]["formula"] == "ranks r + 8i (i < 16384) for r < 8"
    whole = next(k for k in data["kinds"] if k["name"] == "tp-dp")
    assert whole["structure"]["formula"] == "ranks i (i < 131072)"
