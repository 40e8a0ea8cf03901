"""Hypothesis strategies that split a world size into named axes."""

from __future__ import annotations

from hypothesis import strategies as st

from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors

AXIS_NAMES = ("pp", "dp", "ep", "cp", "tp", "sp", "ex")


@st.composite
def axis_sizes(
    draw: st.DrawFn, max_world: int = 256, min_axes: int = 1, max_axes: int = 5
) -> list[tuple[str, int]]:
    """Named axes (root order) whose sizes multiply to a world of at most ``max_world``."""
    count = draw(st.integers(min_axes, max_axes))
    names = draw(st.permutations(AXIS_NAMES).map(lambda p: list(p[:count])))
    sizes = []
    budget = max_world
    for _ in names:
        size = draw(st.sampled_from([d for d in divisors(720720) if d <= budget][:12]))
        sizes.append(size)
        budget //= size
    return list(zip(names, sizes))


@st.composite
def layouts(draw: st.DrawFn, max_world: int = 256, min_axes: int = 1, max_axes: int = 5) -> Layout:
    return Layout(draw(axis_sizes(max_world, min_axes, max_axes)))


@st.composite
def layout_and_dims(draw: st.DrawFn, max_world: int = 256) -> tuple[Layout, tuple[str, ...]]:
    """A layout and a non-empty subset of its dims, in root order."""
    layout = draw(layouts(max_world))
    chosen = draw(st.sets(st.sampled_from(layout.dim_names), min_size=1))
    return layout, tuple(d for d in layout.dim_names if d in chosen)
