"""A picture's page: panels of rectangles and labels, placed on a page that stays viewable.

The views (``rank_view``, ``node_view``) draw each kind's panel in its own coordinates; this
module places the panels, wraps the title and footer to the page width (a title is never cut),
and shrinks the whole page when its long side would pass :data:`MAX_SIDE` pixels: a 35,000
pixel image opens in no viewer.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The long side of a picture, in pixels, never exceeds this (the page is scaled to fit).
MAX_SIDE = 3800
#: Panels flow left to right up to this width before the page grows taller.
FLOW_WIDTH = 1500
MARGIN = 16.0
TITLE_SIZE = 16.0
FOOTER_SIZE = 11.0
_MIN_WIDTH = 420.0


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
    """One kind's picture: its items in the panel's own coordinates, ``(x, y)`` on the page."""

    kind: str
    width: float
    height: float
    items: list[Rect | Label] = field(default_factory=list)
    x: float = 0.0
    y: float = 0.0


@dataclass
class Scene:
    """A page: title lines on top, panels, footer lines below; ``scale`` shrinks it to fit.

    Coordinates are in page units; the image is ``width * scale`` by ``height * scale`` pixels.
    """

    width: float
    height: float
    title_lines: list[str]
    panels: list[Panel]
    footer_lines: list[str] = field(default_factory=list)
    scale: float = 1.0

    @property
    def title(self) -> str:
        return " ".join(self.title_lines)

    @property
    def pixels(self) -> tuple[int, int]:
        """The image's width and height in pixels."""
        return round(self.width * self.scale), round(self.height * self.scale)

    def chrome(self) -> list[Label]:
        """Title lines on top and footer lines at the bottom, in page coordinates."""
        lines = [
            Label(MARGIN, 26 + 20 * i, text, TITLE_SIZE, bold=True)
            for i, text in enumerate(self.title_lines)
        ]
        base = self.height - 16 * len(self.footer_lines) - 8
        lines += [
            Label(MARGIN, base + 16 * (i + 1) - 4, text, FOOTER_SIZE, fill="#8a5a00")
            for i, text in enumerate(self.footer_lines)
        ]
        return lines


def text_width(text: str, size: float, bold: bool = False) -> float:
    """A generous estimate of ``text``'s width in DejaVu Sans (measured: 0.65 em a character
    bold, 0.58 regular, for lowercase and digits), so a line that fits the estimate fits."""
    return len(text) * size * (0.7 if bold else 0.64)


def wrap(text: str, width: float, size: float, bold: bool = False) -> list[str]:
    """``text`` in lines that each fit ``width`` pixels at font ``size``."""
    per_line = max(int(width / (size * (0.7 if bold else 0.64))), 12)
    return textwrap.wrap(text, per_line, break_on_hyphens=False) or [""]


def arrange(title: str, panels: Sequence[Panel], footer: Sequence[str] = ()) -> Scene:
    """Place equally sized ``panels`` on a page under ``title``; wrap, then shrink to fit.

    Panels flow left to right up to :data:`FLOW_WIDTH`; when that page would be taller than
    :data:`MAX_SIDE`, more panels go on each row while that shortens the long side; a page still
    too large is scaled down as a whole (``Scene.scale``).
    """
    pw = max((p.width for p in panels), default=0.0)
    ph = max((p.height for p in panels), default=0.0)
    n = len(panels)

    def size(per_row: int) -> tuple[float, float, list[str], list[str]]:
        width = max(2 * MARGIN + per_row * pw, _MIN_WIDTH)
        heads = wrap(title, width - 2 * MARGIN, TITLE_SIZE, bold=True)
        feet = [line for text in footer for line in wrap(text, width - 2 * MARGIN, FOOTER_SIZE)]
        rows = -(-n // per_row) if n else 0
        height = 20 * len(heads) + 24 + rows * ph + 16 * len(feet) + 16
        return width, height, heads, feet

    per_row = max(1, min(n, int((FLOW_WIDTH - 2 * MARGIN) // pw) if pw else 1))
    best = size(per_row)
    while per_row < n and max(best[0], best[1]) > MAX_SIDE:
        wider = size(per_row + 1)
        if max(wider[0], wider[1]) >= max(best[0], best[1]):
            break
        per_row, best = per_row + 1, wider
    width, height, heads, feet = best
    top = 20 * len(heads) + 20
    for i, panel in enumerate(panels):
        panel.x = MARGIN + (i % per_row) * pw
        panel.y = top + (i // per_row) * ph
    scale = min(1.0, MAX_SIDE / max(width, height))
    return Scene(width, height, heads, list(panels), feet, scale)
