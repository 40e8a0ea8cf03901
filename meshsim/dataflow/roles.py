"""Coordinates the data-flow checks read off the reference: who must see what, in words.

Everything here is derived from :class:`meshsim.Expected` roles, never from the live groups the
program built, so a program that uses the wrong (but well-formed) group is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshsim.errors import RolesUnknown
from meshsim.model.expected import Expected

#: How a message names two ranks that share a group of this role.
PEERS = {"tensor": "TP peers", "context": "CP peers", "pipeline": "pipeline stages"}


def require_known(expected: Expected, *wanted: str) -> None:
    """Raise :class:`~meshsim.errors.RolesUnknown` when a role a check reads is unknown: the
    reference cannot tell it (a torch mesh whose dim names fit no family), and a guess could
    blame correct code."""
    for role in wanted:
        if role in expected.unknown_roles:
            raise RolesUnknown(expected.unknown_roles[role])


def data_groups(expected: Expected) -> list[tuple[int, ...]]:
    """The data-parallel groups (singletons when the layout has no data parallelism)."""
    require_known(expected, "data_parallel")
    if "data_parallel" not in expected.roles:
        return [(r,) for r in range(expected.world_size)]
    return [tuple(g) for g in expected.groups("data_parallel")]


def data_index(expected: Expected) -> dict[int, int]:
    """rank -> its data-parallel rank: ranks with equal values must load the same samples."""
    index = {}
    for group in data_groups(expected):
        for position, rank in enumerate(group):
            index[rank] = position
    return index


def gradient_groups(expected: Expected) -> list[tuple[int, ...]]:
    """The groups gradients must be reduced over (each rank alone when there are none)."""
    require_known(expected, "gradient_reduce")
    if "gradient_reduce" not in expected.roles:
        return [(r,) for r in range(expected.world_size)]
    return [tuple(g) for g in expected.groups("gradient_reduce")]


def relation(expected: Expected, a: int, b: int) -> str:
    """``"CP peers"``, ``"TP peers"``, ... for two ranks with the same data-parallel rank."""
    for role, words in PEERS.items():
        if role in expected.roles:
            group = expected.group_of(a, role)
            if group is not None and b in group:
                return words
    return "model-parallel peers"


def describe_kind(expected: Expected, kind: str) -> str:
    """``get_dp_model_mesh (gradient_reduce: dp_replicate×dp_shard×cp, groups of 4)``."""
    if kind == "<world>":
        return f"the whole world ({expected.world_size} ranks)"
    k = expected.kind(kind)
    parts = [f"role {'/'.join(r for r, n in expected.roles.items() if n == kind)}"]
    if parts[0] == "role ":
        parts = []
    if k.mesh_dims and "×".join(k.mesh_dims) != kind:  # a product kind's name says it
        parts.append("over " + "×".join(k.mesh_dims))
    parts.append(f"groups of {len(k.groups()[0]) if len(k.groups()) else 0}")
    return f"{kind} ({', '.join(parts)})"


def partitions(expected: Expected) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every available kind that partitions the world: the gradient kind, the data kind, others."""
    first = [expected.roles.get(r) for r in ("gradient_reduce", "data_parallel")]
    names = list(dict.fromkeys(n for n in first if n))
    names += [n for n in expected.kinds() if n not in names]
    out: list[tuple[str, list[tuple[int, ...]]]] = []
    for name in names:
        kind = expected.kind(name)
        if kind.partition:
            out.append((name, [tuple(g) for g in kind.groups()]))
    out.append(("<world>", [tuple(range(expected.world_size))]))
    return out


def ranks_list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
