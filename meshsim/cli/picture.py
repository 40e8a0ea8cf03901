"""Pictures of a layout: one panel per group kind, ranks as cells coloured by group (SVG, PNG)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from meshsim.cli.colours import RGB, group_colour, text_colour
from meshsim.cli.render import KindRow, grid_columns, owners
from meshsim.errors import UsageError

_NONE_FILL = "#f4f4f4"
_CROSS = "#c00000"
_MAX_WIDTH = 1500
#: Largest world a picture draws (every rank is a cell in every panel).
PICTURE_LIMIT = 4096


def _hex(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str = "white"
    stroke_width: float = 1.0


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str
    size: float
    fill: str = "black"
    anchor: str = "start"  # start | middle | end
    bold: bool = False


@dataclass
class Panel:
    """One kind's picture: its items, in absolute coordinates."""

    kind: str
    items: list[Rect | Label] = field(default_factory=list)


@dataclass
class Scene:
    width: float
    height: float
    title: str
    panels: list[Panel]
    footer: list[str] = field(default_factory=list)

    def title_lines(self) -> list[str]:
        return textwrap.wrap(self.title, max(int(self.width // 9), 40)) or [""]


def scene(
    title: str,
    rows: Sequence[KindRow],
    world: int,
    *,
    columns: int | None = None,
    gpus_per_node: int | None = None,
    footer: Sequence[str] = (),
) -> Scene:
    """Lay out one panel per kind on a page, panels flowing left to right.

    ``footer`` lines (the kinds the framework refuses under this config) go under the panels.
    """
    if world > PICTURE_LIMIT:
        raise UsageError(
            f"a picture draws every rank; world size {world} is over {PICTURE_LIMIT} "
            "(the table and --json cover any size)"
        )
    width = grid_columns(world, gpus_per_node, columns)
    nrows = -(-world // width)
    cell = 34.0 if width <= 16 else 26.0
    label_w = 62.0 if gpus_per_node else 8.0 * len(str(world - 1)) + 10
    texts = [_texts(row) for row in rows]
    panel_w = max(
        [label_w + width * cell + 24] + [max(len(t) * 8.8, len(u) * 6.4) + 24 for t, u in texts]
    )
    panel_h = 48 + nrows * cell + 20
    per_row = max(1, int(_MAX_WIDTH // panel_w))
    panels = []
    for i, row in enumerate(rows):
        x0 = 16 + (i % per_row) * panel_w
        y0 = 44 + (i // per_row) * panel_h
        panel = Panel(row.name)
        name, sub = texts[i]
        panel.items.append(Label(x0, y0 + 16, name, 14, bold=True))
        panel.items.append(Label(x0, y0 + 32, sub, 11, fill=_CROSS if row.crossing else "#555"))
        owner = owners(row.groups, world)
        crossing = _crossing_ids(row, gpus_per_node)
        gy = y0 + 42
        for r in range(nrows):
            start = r * width
            if gpus_per_node and start % gpus_per_node == 0:
                text = f"node {start // gpus_per_node}"
            else:
                text = "" if gpus_per_node else str(start)
            panel.items.append(
                Label(
                    x0 + label_w - 6,
                    gy + r * cell + cell / 2 + 4,
                    text,
                    10,
                    fill="#777",
                    anchor="end",
                )
            )
        for rank in range(world):
            r, c = divmod(rank, width)
            x, y = x0 + label_w + c * cell, gy + r * cell
            gid = int(owner[rank])
            if gid < 0:
                panel.items.append(Rect(x, y, cell, cell, _NONE_FILL, stroke="#ddd"))
                panel.items.append(
                    Label(
                        x + cell / 2,
                        y + cell / 2 + 4,
                        str(rank),
                        cell * 0.33,
                        fill="#aaa",
                        anchor="middle",
                    )
                )
                continue
            rgb = group_colour(gid, len(row.groups))
            fg = text_colour(rgb)
            if gid in crossing:
                panel.items.append(
                    Rect(x, y, cell, cell, _hex(rgb), stroke=_CROSS, stroke_width=2.5)
                )
            else:
                panel.items.append(Rect(x, y, cell, cell, _hex(rgb)))
            panel.items.append(
                Label(
                    x + cell / 2,
                    y + cell * 0.5,
                    str(rank),
                    cell * 0.36,
                    fill=fg,
                    anchor="middle",
                    bold=True,
                )
            )
            panel.items.append(
                Label(
                    x + cell / 2, y + cell * 0.86, f"g{gid}", cell * 0.25, fill=fg, anchor="middle"
                )
            )
        if gpus_per_node and gpus_per_node > width and gpus_per_node % width == 0:
            for r in range(gpus_per_node // width, nrows, gpus_per_node // width):
                panel.items.append(
                    Rect(
                        x0 + label_w,
                        gy + r * cell - 1.5,
                        width * cell,
                        3,
                        "#222",
                        stroke="none",
                        stroke_width=0,
                    )
                )
        panels.append(panel)
    total_rows = -(-len(rows) // per_row) if rows else 0
    width_px = max(32 + min(len(rows), per_row) * panel_w if rows else 400, 420)
    page = Scene(width_px, 0, title, panels, list(footer))
    top = 20 * (len(page.title_lines()) - 1)
    for panel in panels:  # shift everything below a wrapped title
        panel.items = [_shifted(item, top) for item in panel.items]
    page.height = 52 + top + total_rows * panel_h + 16 * len(page.footer) + 8
    return page


def _shifted(item: Rect | Label, dy: float) -> Rect | Label:
    return replace(item, y=item.y + dy) if dy else item


def _chrome(page: Scene) -> list[Label]:
    """Title lines on top and footer lines at the bottom of the page."""
    lines = [
        Label(16, 26 + 20 * i, text, 16, bold=True) for i, text in enumerate(page.title_lines())
    ]
    base = page.height - 16 * len(page.footer) - 12
    lines += [
        Label(16, base + 16 * (i + 1) - 4, text, 11, fill="#8a5a00")
        for i, text in enumerate(page.footer)
    ]
    return lines


def _texts(row: KindRow) -> tuple[str, str]:
    """A panel's title and subtitle: ``tp`` / ``[tensor] 8 groups of 2, 4 cross nodes``."""
    roles = f"[{', '.join(row.roles)}] " if row.roles else ""
    n = len(row.groups)
    cross = f", {row.crossing} cross nodes" if row.crossing else ""
    return row.name, f"{roles}{n} group{'s' if n != 1 else ''} of {row.groups.group_size}{cross}"


def _crossing_ids(row: KindRow, gpus_per_node: int | None) -> set[int]:
    if not gpus_per_node or not row.crossing:
        return set()
    nodes = row.groups.array // gpus_per_node
    return {int(i) for i in (nodes.min(axis=1) != nodes.max(axis=1)).nonzero()[0]}


def to_svg(page: Scene) -> str:
    """The scene as a standalone SVG document; each panel is ``<g class="panel">``."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{page.width:.0f}" '
        f'height="{page.height:.0f}" viewBox="0 0 {page.width:.0f} {page.height:.0f}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        *(_svg_label(label) for label in _chrome(page)),
    ]
    for panel in page.panels:
        out.append(f'<g class="panel" data-kind={quoteattr(panel.kind)}>')
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
    outputs.write(str(path), lambda stream: stream.write(text))
    return Path(path)


def write_png(page: Scene, path: str | Path, dpi: int = 100) -> Path:
    """Draw the scene with matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise UsageError(
            "--png needs matplotlib: pip install 'meshsim[plot]' "
            "(or use --svg, which needs nothing)"
        ) from None
    fig = plt.figure(figsize=(page.width / 100, page.height / 100), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, page.width)
    ax.set_ylim(page.height, 0)
    ax.axis("off")
    points = 72 / 100  # one SVG pixel in points at 100 px per inch
    items: list[Rect | Label] = list(_chrome(page))
    for panel in page.panels:
        items += panel.items
    for item in items:
        if isinstance(item, Rect):
            edge = "none" if item.stroke == "none" else item.stroke
            ax.add_patch(
                Rectangle(
                    (item.x, item.y),
                    item.w,
                    item.h,
                    facecolor=item.fill,
                    edgecolor=edge,
                    linewidth=item.stroke_width * points,
                )
            )
        else:
            ax.text(
                item.x,
                item.y,
                item.text,
                fontsize=item.size * points,
                color=item.fill,
                ha={"start": "left", "end": "right"}.get(item.anchor, "center"),
                va="baseline",
                fontweight="bold" if item.bold else "normal",
            )
    from meshsim.cli import outputs

    try:
        outputs.write(
            str(path),
            lambda stream: fig.savefig(stream, format="png", dpi=dpi, facecolor="white"),
            binary=True,
        )
    finally:
        plt.close(fig)
    return Path(path)
