"""Terminal output of the CLI: kind tables, rank grids coloured by group, role diffs, JSON."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

from meshsim.cli.colours import group_colour, text_colour
from meshsim.model.expected import Expected
from meshsim.model.groups import Groups, format_groups
from meshsim.model.invariants import crossing_groups
from meshsim.model.structure import structure_of

#: Worlds above this print no text grid (``--svg`` draws them).
GRID_LIMIT = 512
#: ``show --json`` lists, per kind, the first ``--first`` groups as a sample, fewer where they
#: would hold more ranks than this (``--all-groups`` lists every group): the structure (sizes,
#: strides, a formula) says the rest, and one group of 131,072 ranks is a megabyte of JSON.
JSON_SAMPLE_RANKS = 1024
#: The version of every verb's ``--json`` document (``meshsim/cli/schemas/VERB.json``
#: describes each): raised when a field changes meaning or goes away, not when one is added.
JSON_SCHEMA_VERSION = 1


class _Console(Console):
    """rich's Console, but a closed pipe (``meshsim show ... | head``) is not a failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError  # main() ends quietly with exit code 0


def console(stderr: bool = False, quiet: bool = False) -> Console:
    """A rich console; wide when piped so tables do not wrap at 80 columns."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", 0)) or 160
    return _Console(file=stream, width=width, quiet=quiet, highlight=False, soft_wrap=False)


@dataclass(frozen=True)
class KindRow:
    """One group kind as the show table and JSON report it."""

    name: str
    description: str
    roles: tuple[str, ...]
    groups: Groups
    partition: bool
    crossing: int | None  # groups spanning more than one node; None without --gpus-per-node

    def to_json(self, first: int | None = None, max_ranks: int | None = None) -> dict[str, Any]:
        """``first``: list only that many groups (None: all), and no more than fit in
        ``max_ranks`` ranks (None: no limit). The structure is there either way."""
        count = len(self.groups) if first is None else first
        if max_ranks is not None and self.groups.group_size:
            count = min(count, max_ranks // self.groups.group_size)
        listed = self.groups.array[:count]
        found = structure_of(self.groups)
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "roles": list(self.roles),
            "num_groups": len(self.groups),
            "group_size": self.groups.group_size,
            "partition": self.partition,
            "groups": listed.tolist(),
            "groups_complete": len(listed) == len(self.groups),
            "structure": None if found is None else found.to_json(),
        }
        if self.crossing is not None:
            out["groups_crossing_nodes"] = self.crossing
        return out


def kind_rows(expected: Expected, gpus_per_node: int | None = None) -> list[KindRow]:
    """Every available kind of ``expected`` with its roles, groups and node crossings."""
    by_kind: dict[str, list[str]] = {}
    for role, kind in expected.roles.items():
        by_kind.setdefault(kind, []).append(role)
    rows = []
    for name, description in expected.kinds().items():
        groups = expected.groups(name)
        crossing = None if gpus_per_node is None else len(crossing_groups(groups, gpus_per_node))
        rows.append(
            KindRow(
                name,
                description,
                tuple(by_kind.get(name, ())),
                groups,
                expected.kind(name).partition,
                crossing,
            )
        )
    return rows


#: Short names of long framework parameters, for picture titles.
SHORT = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "sequence_parallel_size": "sp",
    "num_distributed_optimizer_instances": "dist_opt_instances",
    "hierarchical_context_parallel_sizes": "hcp",
}


def config_text(config: Mapping[str, Any], short: bool = False) -> str:
    """``key=value ...``: the config without its unset (None/False/empty) values.

    ``short`` writes Megatron's long parameter names as tp/pp/cp/ep/etp.
    """
    parts = []
    for key, value in config.items():
        if short:
            key = SHORT.get(key, key)
        if value is None or value is False or value == ():
            continue
        if isinstance(value, (tuple, list)):
            value = (
                ",".join(map(str, value))
                if all(not isinstance(v, str) or " " not in v for v in value)
                else "; ".join(value)
            )
        parts.append(f"{key}={value}")
    return " ".join(parts)


def show(
    out: Console,
    expected: Expected,
    rows: Sequence[KindRow],
    *,
    first: int = 3,
    grid: bool = True,
    columns: int | None = None,
    gpus_per_node: int | None = None,
    only: Collection[str] | None = None,
) -> None:
    """The show verb's table of kinds, unavailable kinds and the rank grids (of the kinds in
    ``only``, when given: ``rows`` is already cut to them)."""
    budget = max(20, min(48, (out.width - 70) // 2))  # "first groups" text fits the terminal
    out.print(
        f"[bold]{expected.framework}[/bold] world_size={expected.world_size} "
        f"{config_text(expected.config)}"
    )
    describe = out.width >= 110  # narrow terminals drop the description, not the groups
    table = Table(show_lines=False, header_style="bold")
    for title, kw in (
        ("kind", {"style": "cyan", "no_wrap": True}),
        ("description", {"ratio": 4, "overflow": "fold"}),
        ("#groups", {"justify": "right"}),
        ("size", {"justify": "right"}),
        ("first groups", {"no_wrap": True}),
        ("role", {"style": "green", "ratio": 3, "overflow": "fold"}),
    ):
        if describe or title != "description":
            table.add_column(title, **kw)
    if gpus_per_node is not None:
        table.add_column("cross nodes", justify="right")
    for row in rows:
        cells: list[str | Text] = [
            Text(row.name),  # Text: names like dense[tp] are not rich markup
            *([Text(row.description)] if describe else []),
            str(len(row.groups)),
            str(row.groups.group_size),
            first_groups(row.groups, first, budget),
            ", ".join(row.roles),
        ]
        if gpus_per_node is not None:
            cells.append(f"[red]{row.crossing}/{len(row.groups)}[/red]" if row.crossing else "–")
        table.add_row(*cells)
    out.print(table)
    unavailable = {n: e for n, e in expected.unavailable().items() if only is None or n in only}
    if unavailable:
        out.print("[bold]unavailable[/bold] (the framework raises when asked):")
        for name, error in unavailable.items():
            upstream = f"{error.upstream}: " if getattr(error, "upstream", None) else ""
            out.print(Text.assemble("  ", (name, "yellow"), f": {upstream}{error}"))
    if not grid:
        return
    world = expected.world_size
    if world > GRID_LIMIT:
        out.print(f"(rank grids omitted for world size > {GRID_LIMIT}; use --svg)")
        return
    drawn: dict[Groups, str] = {}
    for row in rows:
        header = _grid_title(row)
        if row.groups.group_size == 1 and row.partition:
            out.print(header, Text(": every rank alone", style="dim"), sep="")
        elif row.groups in drawn:
            out.print(header, Text(f": same groups as {drawn[row.groups]}", style="dim"), sep="")
        else:
            drawn[row.groups] = row.name
            rank_grid(out, row, world, columns=columns, gpus_per_node=gpus_per_node)


def first_groups(groups: Groups, first: int, budget: int = 48) -> str:
    """Up to ``first`` groups, fewer when they would pass ``budget`` characters (world 64+)."""
    total = len(groups)
    # A member takes 3 characters or more, so no more than ``budget`` of a group can show:
    # 131,072 ranks in one group are cut before they are formatted, not after.
    head = [tuple(row) for row in groups.array[: max(first, 1), :budget].tolist()]
    text = format_groups(head[:1], 1, total) if total else "[]"
    for n in range(2, min(first, total) + 1):
        longer = format_groups(head[:n], n, total)
        if len(longer) > budget:
            break
        text = longer
    if len(text) > budget:  # one huge group: cut inside it
        more = f", ... {total - 1} more]" if total > 1 else "]"
        cut = text[: max(budget - len(more) - 5, 8)].rsplit(",", 1)[0]
        text = cut + ", ...)" + more
    return text


def owners(groups: Groups, world: int) -> npt.NDArray[np.int64]:
    """Group index of every rank (-1 when in no group; the first group when in several)."""
    owner = np.full(world, -1, dtype=np.int64)
    rows = groups.array
    ids = np.repeat(np.arange(len(groups), dtype=np.int64), groups.group_size)
    owner[rows.ravel()[::-1]] = ids[::-1]
    return owner


def grid_columns(world: int, gpus_per_node: int | None, columns: int | None) -> int:
    """Ranks per grid row: the node size when known, else 8 (16/32 for larger worlds)."""
    if columns:
        return min(columns, world)
    if gpus_per_node:
        return min(gpus_per_node, world)
    return min(world, 8 if world <= 64 else 16 if world <= 256 else 32)


def _grid_title(row: KindRow) -> Text:
    roles = f" [{', '.join(row.roles)}]" if row.roles else ""
    return Text.assemble((row.name, "bold cyan"), (roles, "green"))


def rank_grid(
    out: Console,
    row: KindRow,
    world: int,
    *,
    columns: int | None = None,
    gpus_per_node: int | None = None,
) -> None:
    """Ranks laid out in rows, each cell the id of the rank's group (coloured by group).

    Example, Megatron world 8 tp=2: tp groups read ``0 0 1 1 2 2 3 3``.
    """
    width = grid_columns(world, gpus_per_node, columns)
    owner = owners(row.groups, world)
    n = len(row.groups)
    cell = max(len(str(max(n - 1, 0))), len(f"+{width - 1}")) + 1
    label = len(str(world - 1)) + (5 if gpus_per_node else 0)
    crossing = f", {row.crossing} cross nodes" if row.crossing else ""
    out.print(_grid_title(row), f": {n} groups of {row.groups.group_size}{crossing}", sep="")
    header = Text(" " * (label + 1))
    for c in range(width):
        header.append(f"+{c}".rjust(cell))
    out.print(header, style="dim")
    for start in range(0, world, width):
        name = str(start).rjust(len(str(world - 1)))
        if gpus_per_node:
            name = (
                f"n{start // gpus_per_node:<3} {name}"
                if start % gpus_per_node == 0
                else " " * label
            )
        line = Text(name.ljust(label) + " ", style="dim")
        for rank in range(start, min(start + width, world)):
            gid = int(owner[rank])
            if gid < 0:
                line.append("·".rjust(cell), style="dim")
                continue
            rgb = group_colour(gid, n)
            style = Style(color=text_colour(rgb), bgcolor=f"rgb({rgb[0]},{rgb[1]},{rgb[2]})")
            line.append(" ")
            line.append(str(gid).rjust(cell - 1), style=style)
        out.print(line)


#: A top-level list longer than this (a sweep's 50,123 results at world 1,024) is written one
#: compact item per line: ``grep`` finds one layout's entry, and writing takes a third of the
#: time (``json`` indents in pure Python).
ONE_PER_LINE: Final = 64


def print_json(data: Any, stream: Any = None) -> None:
    """JSON for machines: tuples as lists, unknown objects (callables) as their repr."""
    out = stream or sys.stdout
    if not isinstance(data, dict) or not data or not all(isinstance(k, str) for k in data):
        json.dump(data, out, indent=2, default=_jsonable)
        out.write("\n")
        return
    out.write("{")
    for at, (key, value) in enumerate(data.items()):
        out.write(("," if at else "") + f"\n  {json.dumps(key)}: ")
        if isinstance(value, (list, tuple)) and len(value) > ONE_PER_LINE:
            for number, item in enumerate(value):
                out.write(("[" if number == 0 else ",") + "\n    ")
                out.write(json.dumps(item, default=_jsonable))
            out.write("\n  ]")
        else:
            out.write(json.dumps(value, indent=2, default=_jsonable).replace("\n", "\n  "))
    out.write("\n}\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return repr(value)


def show_json(
    expected: Expected,
    rows: Iterable[KindRow],
    gpus_per_node: int | None = None,
    only: Collection[str] | None = None,
    first: int = 3,
    all_groups: bool = False,
) -> dict[str, Any]:
    """``show --json`` without its verb fields: each kind's structure and a sample of its
    groups (the first ``first``, at most :data:`JSON_SAMPLE_RANKS` ranks), or with
    ``all_groups`` every group (the listing before the structure came, at any world)."""
    unavailable = {n: e for n, e in expected.unavailable().items() if only is None or n in only}
    sample = {} if all_groups else {"first": first, "max_ranks": JSON_SAMPLE_RANKS}
    return {
        "framework": expected.framework,
        "world_size": expected.world_size,
        "config": dict(expected.config),
        "gpus_per_node": gpus_per_node,
        "roles": dict(expected.roles),
        "all_groups": all_groups,
        "kinds": [row.to_json(**sample) for row in rows],
        "unavailable": {
            name: {"error": str(err), "upstream": getattr(err, "upstream", None)}
            for name, err in unavailable.items()
        },
    }
