"""Pictures of a layout, as SVG or PNG: a rank-level view (a cell per rank) up to
:data:`~meshsim.cli.rank_view.RANK_VIEW_LIMIT` ranks or inside ``--zoom``, a node-level view
(a cell per node) beyond."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from meshsim.cli import node_view, rank_view
from meshsim.cli.page import Label, Rect, Scene, arrange
from meshsim.cli.rank_view import RANK_VIEW_LIMIT
from meshsim.cli.render import KindRow
from meshsim.errors import UsageError


def scene(
    title: str,
    rows: Sequence[KindRow],
    world: int,
    *,
    columns: int | None = None,
    gpus_per_node: int | None = None,
    footer: Sequence[str] = (),
    zoom: range | None = None,
) -> Scene:
    """The page for ``rows``: ranks one by one when the world (or the ``zoom`` window) holds at
    most :data:`RANK_VIEW_LIMIT` ranks, else one cell per node.

    ``footer`` lines (the kinds the framework refuses under this config) go under the panels.
    """
    if zoom is None and world <= RANK_VIEW_LIMIT:
        zoom = range(world)
    if zoom is not None:
        check_zoom(zoom, world)
        if len(zoom) < world:
            title += f" · ranks {zoom.start}-{zoom.stop - 1}"
        drawn = rank_view.panels(rows, world, zoom, columns=columns, gpus_per_node=gpus_per_node)
        return arrange(title, drawn, footer)
    drawn = node_view.panels(rows, world, gpus_per_node)
    return arrange(title, drawn, [*node_view.notes(world, gpus_per_node), *footer])


def check_zoom(zoom: range, world: int) -> None:
    """Refuse a window outside the world or wider than a rank-level picture draws."""
    if not 0 <= zoom.start < zoom.stop <= world:
        raise UsageError(
            f"--zoom {zoom.start}:{zoom.stop} is not a window of ranks 0 to {world - 1}; "
            f"give START:END with 0 <= START < END <= {world}, e.g. --zoom 0:{min(world, 64)}"
        )
    if len(zoom) > RANK_VIEW_LIMIT:
        raise UsageError(
            f"--zoom {zoom.start}:{zoom.stop} holds {len(zoom)} ranks; a rank-level picture "
            f"draws at most {RANK_VIEW_LIMIT}, e.g. --zoom {zoom.start}:"
            f"{zoom.start + RANK_VIEW_LIMIT}"
        )


def parse_zoom(text: str) -> range:
    """``START:END`` as the ranks ``range(START, END)``."""
    start, colon, stop = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return range(int(start), int(stop))
    except ValueError:
        raise UsageError(
            f"--zoom takes START:END, the ranks START to END-1 (e.g. --zoom 0:64), got {text!r}"
        ) from None


def to_svg(page: Scene) -> str:
    """The scene as a standalone SVG document; each panel is ``<g class="panel">``, moved into
    place by a translation; a scaled page keeps its coordinates in ``viewBox``."""
    width, height = page.pixels
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {page.width:.0f} {page.height:.0f}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        *(_svg_label(label) for label in page.chrome()),
    ]
    for panel in page.panels:
        out.append(
            f'<g class="panel" data-kind={quoteattr(panel.kind)} '
            f'transform="translate({panel.x:.1f},{panel.y:.1f})">'
        )
        out.append(f"<title>{escape(panel.kind)}</title>")
        for item in panel.items:
            out.append(_svg_rect(item) if isinstance(item, Rect) else _svg_label(item))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_rect(r: Rect) -> str:
    stroke = "" if r.stroke == "none" else f' stroke="{r.stroke}" stroke-width="{r.stroke_width:g}"'
    return (
        f'<rect x="{r.x:.1f}" y="{r.y:.1f}" width="{r.w:.1f}" height="{r.h:.1f}" '
        f'fill="{r.fill}"{stroke}/>'
    )


def _svg_label(t: Label) -> str:
    weight = ' font-weight="bold"' if t.bold else ""
    return (
        f'<text x="{t.x:.1f}" y="{t.y:.1f}" font-size="{t.size:.1f}" fill="{t.fill}" '
        f'text-anchor="{t.anchor}"{weight}>{escape(t.text)}</text>'
    )


def write_svg(page: Scene, path: str | Path) -> Path:
    from meshsim.cli import outputs

    text = to_svg(page)

    def put(stream: Any) -> None:
        stream.write(text)

    outputs.write(str(path), put)
    return Path(path)


def write_png(page: Scene, path: str | Path) -> Path:
    """Draw the scene with Pillow in matplotlib's DejaVu fonts (the ``plot`` extra installs
    both): a text at a time, Pillow draws thousands of labels in well under a second, where
    matplotlib's Agg text took 20 ms each (a 1,024-rank picture took minutes)."""
    fonts = _fonts()  # refuses first when the plot extra is missing
    from PIL import Image, ImageDraw

    scale = page.scale
    image = Image.new("RGB", page.pixels, "white")
    draw = ImageDraw.Draw(image)
    placed: list[tuple[float, float, Rect | Label]] = [(0, 0, item) for item in page.chrome()]
    for panel in page.panels:
        placed += [(panel.x, panel.y, item) for item in panel.items]
    for dx, dy, item in placed:
        x, y = (dx + item.x) * scale, (dy + item.y) * scale
        if isinstance(item, Rect):
            outline = None if item.stroke == "none" else item.stroke
            width = max(1, round(item.stroke_width * scale)) if outline else 0
            box = (x, y, x + max(item.w * scale - 1, 0), y + max(item.h * scale - 1, 0))
            draw.rectangle(box, fill=item.fill, outline=outline, width=width)
        else:
            anchor = {"start": "ls", "end": "rs"}.get(item.anchor, "ms")
            font = fonts(item.bold, round(item.size * scale * 4) / 4)
            draw.text((x, y), item.text, fill=item.fill, font=font, anchor=anchor)
    from meshsim.cli import outputs

    outputs.write(str(path), lambda stream: image.save(stream, format="PNG"), binary=True)
    return Path(path)


def _fonts() -> Callable[[bool, float], Any]:
    """DejaVu Sans (regular, bold) at any size, from matplotlib's own font folder: found, not
    imported (importing matplotlib costs half a second)."""
    spec = importlib.util.find_spec("matplotlib")
    folders = spec.submodule_search_locations if spec is not None else None
    folder = Path(next(iter(folders or ["."]))) / "mpl-data" / "fonts" / "ttf"
    try:
        from PIL import ImageFont
    except ImportError:
        folder = Path("/nonexistent")
    if not (folder / "DejaVuSans.ttf").is_file():
        raise UsageError(
            "--png needs matplotlib: pip install 'meshsim[plot]' "
            "(or use --svg, which needs nothing)"
        )

    @functools.cache
    def font(bold: bool, size: float) -> Any:
        name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
        return ImageFont.truetype(str(folder / name), max(size, 1.0))

    return font
