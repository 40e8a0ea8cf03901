"""The node-level picture: one strip per kind, a cell per node, saying which groups touch it.

At 1,024 ranks a cell per rank is 24 panels of 1,024 cells (a 35,000 pixel page); what a
reader asks there is which nodes a kind's groups touch and whether they leave them. So a cell
is a node (or a run of nodes, when there are more than :data:`MAX_COLUMNS`): ``g5`` when one
group of the kind touches it, ``×8`` when several do, shaded from blue (all of them inside the
node) to red (all of them spanning several nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meshsim.cli.colours import RGB, hex_colour
from meshsim.cli.page import Label, Panel, Rect, text_width
from meshsim.cli.rank_view import CROSS, NONE_FILL, subtitle
from meshsim.cli.render import KindRow
from meshsim.model.structure import structure_of

#: Ranks per node when ``--gpus-per-node`` is not given (8 GPUs: the common node).
NODE_SIZE = 8
#: Most cells in a strip; more nodes share a cell (a run of nodes).
MAX_COLUMNS = 128
_INSIDE: RGB = (198, 219, 239)
_SPANNING: RGB = (244, 165, 130)
_CELL_H = 22.0
_FONT = 9.0


@dataclass(frozen=True)
class Columns:
    """How nodes map to cells: ``per_cell`` consecutive nodes of ``node_size`` ranks each."""

    node_size: int
    nodes: int
    per_cell: int

    @classmethod
    def of(cls, world: int, node_size: int) -> Columns:
        nodes = -(-world // node_size)
        return cls(node_size, nodes, -(-nodes // MAX_COLUMNS))

    @property
    def count(self) -> int:
        return -(-self.nodes // self.per_cell)

    def label(self, column: int) -> str:
        first = column * self.per_cell
        return f"n{first}" if self.per_cell == 1 else f"n{first}-{first + self.per_cell - 1}"


@dataclass(frozen=True)
class Touch:
    """One kind over the cells: groups touching each cell, how many of those span several
    nodes, the group id where exactly one touches; the nodes a group spans (min, max) and how
    many groups span more than one."""

    groups: npt.NDArray[np.int64]
    spanning: npt.NDArray[np.int64]
    only: npt.NDArray[np.int64]
    spans: tuple[int, int]
    crossing: int


def touch(row: KindRow, columns: Columns) -> Touch:
    """Count, per cell, the groups of ``row`` with a member in it (vectorised: O(ranks))."""
    array = row.groups.array
    if array.size == 0:
        zero = np.zeros(columns.count, dtype=np.int64)
        return Touch(zero, zero, zero, (0, 0), 0)
    nodes = np.sort(array // columns.node_size, axis=1)
    spans = 1 + (np.diff(nodes, axis=1) != 0).sum(axis=1)
    cells = nodes // columns.per_cell  # sorted too: nodes are
    first = np.ones(cells.shape, dtype=bool)
    first[:, 1:] = np.diff(cells, axis=1) != 0  # each (group, cell) pair once
    ids = np.broadcast_to(np.arange(len(array), dtype=np.int64)[:, None], cells.shape)[first]
    where = cells[first]
    n = columns.count
    count = np.bincount(where, minlength=n)
    spanning = np.bincount(where, weights=(spans > 1)[ids], minlength=n).astype(np.int64)
    only = np.bincount(where, weights=ids, minlength=n).astype(np.int64)  # read where count 1
    return Touch(
        count, spanning, only, (int(spans.min()), int(spans.max())), int((spans > 1).sum())
    )


def panels(rows: Sequence[KindRow], world: int, gpus_per_node: int | None) -> list[Panel]:
    """One strip per kind over the nodes of ``gpus_per_node`` ranks (else :data:`NODE_SIZE`)."""
    columns = Columns.of(world, gpus_per_node or NODE_SIZE)
    touches = [touch(row, columns) for row in rows]
    texts = [cell_texts(t) for t in touches]
    longest = max((text_width(s, _FONT) for ts in texts for s in ts), default=0.0)
    cell = min(max(20.0, longest + 4), 48.0)
    lines = [(subtitle_of(row, t), rule_of(row)) for row, t in zip(rows, touches)]
    width = max(
        [columns.count * cell]
        + [text_width(row.name, 13, True) for row in rows]
        + [max(text_width(a, 11), text_width(b, 10)) for a, b in lines]
    )
    out = []
    for row, t, cell_text, (sub, rule) in zip(rows, touches, texts, lines):
        panel = Panel(row.name, width + 24, 100.0)
        items = panel.items
        items.append(Label(0, 14, row.name, 13, bold=True))
        items.append(Label(0, 30, sub, 11, fill=CROSS if t.spanning.any() else "#555"))
        items.append(Label(0, 45, rule, 10, fill="#555"))
        y = 52.0
        for c in range(columns.count):
            x = c * cell
            if not t.groups[c]:
                items.append(Rect(x, y, cell, _CELL_H, NONE_FILL, stroke="#ddd"))
                continue
            rgb = _shade(t.spanning[c] / t.groups[c])
            items.append(Rect(x, y, cell, _CELL_H, hex_colour(rgb)))
            text = cell_text[c]
            size = min(_FONT, (cell - 4) / (0.64 * len(text)))
            items.append(
                Label(x + cell / 2, y + _CELL_H / 2 + size * 0.35, text, size, "black", "middle")
            )
        step = _label_step(columns, cell)
        for c in range(0, columns.count, step):
            items.append(Label(c * cell + 1, y + _CELL_H + 11, columns.label(c), 8, "#777"))
        out.append(panel)
    return out


def cell_texts(t: Touch) -> list[str]:
    """``g5`` where one group touches the cell, ``×8`` where several do, ``""`` where none."""
    out = []
    for count, only in zip(t.groups.tolist(), t.only.tolist()):
        out.append("" if count == 0 else f"g{only}" if count == 1 else f"×{_compact(count)}")
    return out


def subtitle_of(row: KindRow, t: Touch) -> str:
    """``[tensor] 128 groups of 8, each inside one node`` or ``..., 64 span 2-8 nodes``."""
    base = subtitle(row, crossing=False)
    if not len(row.groups):
        return base
    low, high = t.spans
    if high <= 1:
        return f"{base}, each inside one node"
    reach = f"{low}" if low == high else f"{low}-{high}"
    many = "each spans" if t.crossing == len(row.groups) else f"{t.crossing} span"
    return f"{base}, {many} {reach} nodes"


def rule_of(row: KindRow) -> str:
    """The sizes-and-strides rule of the kind's groups, or where to find them otherwise."""
    found = structure_of(row.groups)
    if found is None:
        return "no strided rule generates these groups (show --json --all-groups lists them)"
    return found.formula()


def notes(world: int, gpus_per_node: int | None) -> list[str]:
    """The footer lines that say how to read a node-level picture."""
    columns = Columns.of(world, gpus_per_node or NODE_SIZE)
    nodes = f"{columns.nodes} nodes of {columns.node_size} ranks"
    if gpus_per_node is None:
        nodes += f" ({NODE_SIZE} assumed: --gpus-per-node G sets it)"
    cells = "a node" if columns.per_cell == 1 else f"{columns.per_cell} nodes"
    return [
        f"Node view of {nodes}: each cell is {cells}. gN: the one group of the kind there; "
        "×N: the number of its groups that touch it. Blue: those groups stay inside one node; "
        "red: they span several. --zoom START:END draws ranks START to END-1 one by one.",
    ]


def _shade(share: float) -> RGB:
    r, g, b = (round(a + (z - a) * share) for a, z in zip(_INSIDE, _SPANNING))
    return r, g, b


def _compact(count: int) -> str:
    return str(count) if count < 10_000 else f"{count // 1000}k"


def _label_step(columns: Columns, cell: float) -> int:
    widest = text_width(columns.label(columns.count - 1), 8) + 6
    return max(1, int(-(-widest // cell)))
