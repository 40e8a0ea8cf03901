"""``meshsim show --svg/--png`` at scale: a node-level view past 256 ranks, a rank-level
``--zoom``, pages that stay under 4,000 pixels, distinct group colours, whole titles."""

from __future__ import annotations

import importlib.util
import re
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshsim.cli.colours import group_colour
from meshsim.cli.page import MAX_SIDE, Label, Panel, arrange
from tests.cli.helpers import assert_bad_input, run_cli

SVG = "{http://www.w3.org/2000/svg}"
INSIDE, SPANNING = "#c6dbef", "#f4a582"  # node view: groups inside one node / spanning several
needs_plot = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs meshsim[plot]"
)


def svg_size(path: Path) -> tuple[int, int]:
    root = ET.parse(path).getroot()
    return int(root.get("width", 0)), int(root.get("height", 0))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, which follows the 8-byte signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def panels(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    return {g.get("data-kind", ""): g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"}


def cells(panel: ET.Element) -> list[tuple[str, str]]:
    """(text, fill) of each node cell, left to right: the rectangle and the label centred in it."""
    rects = [r for r in panel.iter(f"{SVG}rect") if r.get("height") == "22.0"]
    texts = [
        (float(t.get("x", 0)), t.text or "")
        for t in panel.iter(f"{SVG}text")
        if re.fullmatch(r"g\d+|×\S+", t.text or "")
    ]
    out = []
    for rect in rects:
        middle = float(rect.get("x", 0)) + float(rect.get("width", 0)) / 2
        text = [s for x, s in texts if abs(x - middle) < 0.2]
        out.append((text[0] if text else "", rect.get("fill", "")))
    return out


def test_1024_ranks_draw_one_cell_per_node(tmp_path: Path) -> None:
    target = tmp_path / "w1024.svg"
    result = run_cli(
        "show", "megatron", "-n", "1024", "--tp", "16", "--gpus-per-node", "16",
        "--svg", str(target), "--no-grid",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    width, height = svg_size(target)
    assert max(width, height) < 4000 and f"{width} x {height} px" in result.stdout
    drawn = panels(target)
    # 64 nodes of 16 ranks: tp group c is node c, whole; every node holds one rank of each of
    # the 16 dp groups, and each dp group spans all 64 nodes.
    assert cells(drawn["tp"]) == [(f"g{c}", INSIDE) for c in range(64)]
    assert cells(drawn["dp"]) == [("×16", SPANNING)] * 64
    text = target.read_text()
    assert "[tensor] 64 groups of 16, each inside one node" in text
    assert "[data_parallel] 16 groups of 64, each spans 64 nodes" in text
    assert "ranks r + i (i &lt; 16) for r = 16a (a &lt; 64)" in text  # the formula, escaped
    assert "Node view of 64 nodes of 16 ranks" in text


def test_many_nodes_share_a_cell_and_131072_ranks_fit(tmp_path: Path) -> None:
    target = tmp_path / "w131072.svg"
    mesh = ("--mesh-shape", "16384,8", "--mesh-dim-names", "dp,tp")
    result = run_cli("show", "torch", "-n", "131072", *mesh, "--svg", str(target), "--no-grid")
    assert result.returncode == 0, result.stderr
    width, height = svg_size(target)
    assert max(width, height) < 4000
    tp = cells(panels(target)["tp"])
    assert len(tp) == 128  # 16,384 nodes of 8 (assumed), 128 to a cell
    assert tp[0] == ("×128", INSIDE) and len(set(tp)) == 1
    assert "each cell is 128 nodes" in target.read_text()
    assert "(8 assumed: --gpus-per-node G sets it)" in target.read_text()


@needs_plot
def test_png_of_1024_ranks_stays_under_4000_pixels(tmp_path: Path) -> None:
    target = tmp_path / "w1024.png"
    result = run_cli(
        "show", "megatron", "-n", "1024", "--png", str(target), "--no-grid", "--kinds", "tp,dp,pp"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    width, height = png_size(target)
    assert max(width, height) < 4000 and f"{width} x {height} px" in result.stdout


def test_zoom_draws_a_window_of_ranks_in_distinct_colours(tmp_path: Path) -> None:
    target = tmp_path / "zoom.svg"
    result = run_cli(
        "show", "megatron", "-n", "1024", "--tp", "2", "--svg", str(target), "--zoom", "64:128",
        "--kinds", "tp",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tp = panels(target)["tp"]
    squares = [r for r in tp.iter(f"{SVG}rect") if r.get("width") == r.get("height")]
    assert len(squares) == 64  # one cell per rank of the window
    labels = {t.text for t in tp.iter(f"{SVG}text")}
    assert {str(r) for r in range(64, 128)} <= labels and "g32" in labels and "g63" in labels
    assert len({r.get("fill") for r in squares}) == 32  # 32 groups, 32 colours
    assert "ranks 64-127" in target.read_text()


def test_group_colours_stay_distinct_past_sixteen_groups() -> None:
    for count in (17, 64, 4096):
        colours = [group_colour(i, count) for i in range(count)]
        assert len(set(colours)) == count, count
    window = [group_colour(i, 100_000) for i in range(50_000, 50_256)]  # a zoom's 256 groups
    closest = min(
        sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5
        for i, a in enumerate(window)
        for b in window[i + 1 :]
    )
    assert closest > 8  # apart, not merely different in the last bit
    neighbours = [
        sum((x - y) ** 2 for x, y in zip(window[i], window[i + 1])) ** 0.5 for i in range(255)
    ]
    assert min(neighbours) > 60  # adjacent groups never look alike


def test_a_long_title_is_wrapped_whole(tmp_path: Path) -> None:
    target = tmp_path / "title.svg"
    result = run_cli(
        "show", "megatron", "-n", "1024", "--tp", "2", "--pp", "4", "--cp", "2", "--ep", "4",
        "--num-distributed-optimizer-instances", "2", "--gpus-per-node", "8",
        "--svg", str(target), "--kinds", "tp", "--zoom", "0:16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    root = ET.parse(target).getroot()
    page_width = float(root.get("viewBox", "0 0 0 0").split()[2])
    lines = [
        t.text or ""
        for t in root.findall(f"{SVG}text")
        if t.get("font-size") == "16.0" and t.get("font-weight") == "bold"
    ]
    title = " ".join(lines)
    assert len(lines) > 2  # a 16-rank panel makes a narrow page
    assert title.startswith("megatron · world 1024 · tp=2 pp=4 cp=2 ep=4")
    assert "dist_opt_instances=2" in title and "create_gloo_process_groups=True" in title
    assert title.endswith("· 8 GPUs per node · ranks 0-15")
    for line in lines:  # each line fits the page, in the font the page names
        assert _width(line, 16) <= page_width - 16, line


def _width(text: str, size: float) -> float:
    """``text``'s width in DejaVu Sans Bold where Pillow and matplotlib's font are here."""
    try:
        import matplotlib
        from PIL import ImageFont
    except ImportError:
        return len(text) * size * 0.7
    font = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans-Bold.ttf"
    return float(ImageFont.truetype(str(font), size).getlength(text))


def test_a_page_of_many_panels_is_scaled_under_the_limit() -> None:
    many = [Panel(f"k{i}", 700, 400, [Label(0, 10, "x", 10)]) for i in range(230)]
    page = arrange("torchtitan · world 1024", many)
    assert max(page.pixels) <= MAX_SIDE < max(page.width, page.height)
    assert page.scale < 1
    few = arrange("t", [Panel("a", 300, 200)])
    assert few.scale == 1 and few.pixels == (round(few.width), round(few.height))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--svg", "{tmp}/a.svg", "--zoom", "8"), "--zoom takes START:END"),
        (("--svg", "{tmp}/a.svg", "--zoom", "60:80"), "not a window of ranks 0 to 63"),
        (("--zoom", "0:8"), "give --svg or --png too"),
    ],
)
def test_bad_zoom_is_refused_in_one_line(
    args: tuple[str, ...], needle: str, tmp_path: Path
) -> None:
    argv = [a.format(tmp=tmp_path) for a in args]
    assert_bad_input(run_cli("show", "megatron", "-n", "64", *argv), needle)
    assert not (tmp_path / "a.svg").exists()
