"""The rank-level picture: every rank of a window a cell, coloured and labelled by its group."""

from __future__ import annotations

from collections.abc import Sequence

from meshsim.cli.colours import group_colour, hex_colour, text_colour
from meshsim.cli.page import Label, Panel, Rect, text_width
from meshsim.cli.render import KindRow, grid_columns, owners

NONE_FILL = "#f4f4f4"
CROSS = "#c00000"
#: The most ranks a rank-level picture draws (a wider ``--zoom`` is refused).
RANK_VIEW_LIMIT = 256


def panels(
    rows: Sequence[KindRow],
    world: int,
    ranks: range,
    *,
    columns: int | None = None,
    gpus_per_node: int | None = None,
) -> list[Panel]:
    """One panel per kind: the ranks of ``ranks`` in rows of ``columns`` (else the node size,
    else 8/16/32), each cell the rank and its group id, groups that cross nodes outlined red."""
    count = len(ranks)
    width = grid_columns(count, gpus_per_node, columns)
    nrows = -(-count // width)
    cell = 34.0 if width <= 16 else 26.0
    label_w = 62.0 if gpus_per_node else 8.0 * len(str(ranks[-1])) + 10
    texts = [subtitle(row) for row in rows]
    panel_w = max(
        [label_w + width * cell + 24]
        + [
            max(text_width(row.name, 14, True), text_width(sub, 11)) + 24
            for row, sub in zip(rows, texts)
        ]
    )
    panel_h = 48 + nrows * cell + 20
    out = []
    for row, sub in zip(rows, texts):
        panel = Panel(row.name, panel_w, panel_h)
        items = panel.items
        items.append(Label(0, 16, row.name, 14, bold=True))
        items.append(Label(0, 32, sub, 11, fill=CROSS if row.crossing else "#555"))
        owner = owners(row.groups, world)
        crossing = _crossing_ids(row, gpus_per_node)
        gy = 42.0
        for r in range(nrows):
            start = ranks.start + r * width
            if gpus_per_node and start % gpus_per_node == 0:
                text = f"node {start // gpus_per_node}"
            else:
                text = "" if gpus_per_node else str(start)
            items.append(
                Label(
                    label_w - 6, gy + r * cell + cell / 2 + 4, text, 10, fill="#777", anchor="end"
                )
            )
        for i, rank in enumerate(ranks):
            r, c = divmod(i, width)
            x, y = label_w + c * cell, gy + r * cell
            gid = int(owner[rank])
            if gid < 0:
                items.append(Rect(x, y, cell, cell, NONE_FILL, stroke="#ddd"))
                items.append(
                    Label(x + cell / 2, y + cell / 2 + 4, str(rank), cell * 0.33, "#aaa", "middle")
                )
                continue
            rgb = group_colour(gid, len(row.groups))
            fg = text_colour(rgb)
            if gid in crossing:
                items.append(Rect(x, y, cell, cell, hex_colour(rgb), CROSS, 2.5))
            else:
                items.append(Rect(x, y, cell, cell, hex_colour(rgb)))
            items.append(
                Label(x + cell / 2, y + cell * 0.5, str(rank), cell * 0.36, fg, "middle", True)
            )
            items.append(Label(x + cell / 2, y + cell * 0.86, f"g{gid}", cell * 0.25, fg, "middle"))
        if gpus_per_node and gpus_per_node > width and gpus_per_node % width == 0:
            step = gpus_per_node // width
            for r in range(step, nrows, step):  # a dark line between nodes
                items.append(Rect(label_w, gy + r * cell - 1.5, width * cell, 3, "#222", "none", 0))
        out.append(panel)
    return out


def subtitle(row: KindRow, crossing: bool = True) -> str:
    """A panel's subtitle: ``[tensor] 8 groups of 2, 4 cross nodes`` (without the crossing
    count when ``crossing`` is False)."""
    roles = f"[{', '.join(row.roles)}] " if row.roles else ""
    n = len(row.groups)
    cross = f", {row.crossing} cross nodes" if row.crossing and crossing else ""
    return f"{roles}{n} group{'s' if n != 1 else ''} of {row.groups.group_size}{cross}"


def _crossing_ids(row: KindRow, gpus_per_node: int | None) -> set[int]:
    if not gpus_per_node or not row.crossing:
        return set()
    nodes = row.groups.array // gpus_per_node
    return {int(i) for i in (nodes.min(axis=1) != nodes.max(axis=1)).nonzero()[0]}
