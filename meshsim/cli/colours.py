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


#: Steps of the 3-D Kronecker sequence (powers of 1/g, g the plastic ratio's 3-D sibling, the
#: root of x**4 = x + 1): consecutive colours land far apart in hue, lightness and saturation,
#: and no two of the first 65,536 groups share a colour (the golden ratio alone, hue only,
#: repeated colours from about 1,000 groups on).
_G = 1.2207440846057596
_STEPS = (1 / _G, 1 / _G**2, 1 / _G**3)


def group_colour(index: int, count: int) -> RGB:
    """Colour of group ``index`` of ``count``: neighbours differ in hue and lightness.

    Up to ten groups take Tableau 10; more walk a low-discrepancy sequence through hue,
    lightness and saturation, so any 256 groups in a row (a rank-level picture's window) are
    clearly apart. Example: ``group_colour(0, 2)`` is Tableau blue ``(78, 121, 167)``.
    """
    if count <= len(_TABLEAU):
        return _TABLEAU[index % len(_TABLEAU)]
    hue, light, saturation = ((0.5 + index * step) % 1.0 for step in _STEPS)
    r, g, b = colorsys.hls_to_rgb(hue, 0.36 + 0.38 * light, 0.45 + 0.45 * saturation)
    return round(r * 255), round(g * 255), round(b * 255)


def hex_colour(rgb: RGB) -> str:
    """``#4e79a7``: the colour as SVG and matplotlib take it."""
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def text_colour(rgb: RGB) -> str:
    """Black on light cells, white on dark ones."""
    luminance = (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) / 255
    return "black" if luminance > 0.55 else "white"
