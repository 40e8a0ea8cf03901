"""Group colours shared by the terminal's rank grids and the pictures, so both read alike."""

from __future__ import annotations

import colorsys

RGB = tuple[int, int, int]

# Tableau 10: distinct and readable for up to ten groups; more groups walk the hue circle.
_TABLEAU: tuple[RGB, ...] = (
    (78, 121, 167),
    (242, 142, 43),
    (225, 87, 89),
    (118, 183, 178),
    (89, 161, 79),
    (237, 201, 72),
    (176, 122, 161),
    (255, 157, 167),
    (156, 117, 95),
    (186, 176, 172),
)


def group_colour(index: int, count: int) -> RGB:
    """Colour of group ``index`` of ``count``: neighbours differ in hue and lightness.

    Example: ``group_colour(0, 2)`` is Tableau blue ``(78, 121, 167)``.
    """
    if count <= len(_TABLEAU):
        return _TABLEAU[index % len(_TABLEAU)]
    hue = (index * 0.618033988749895) % 1.0  # golden-ratio steps spread any count evenly
    light = (0.62, 0.48, 0.72)[index % 3]
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.62)
    return round(r * 255), round(g * 255), round(b * 255)


def text_colour(rgb: RGB) -> str:
    """Black on light cells, white on dark ones."""
    luminance = (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) / 255
    return "black" if luminance > 0.55 else "white"
