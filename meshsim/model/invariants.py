"""Invariants every correct layout satisfies, as pure vectorised checks over group families.

Each ``is_*`` function answers a yes/no question about group families; ``find_violations``
runs every check that applies to an :class:`Expected` and says, in words, what is broken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from meshsim.errors import LayoutError
from meshsim.model.expected import Expected
from meshsim.model.groups import Groups, format_groups


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which check, on which kind, an example, and what goes wrong in
    training when a job runs with it (``consequence``)."""

    check: str
    kind: str
    message: str
    consequence: str = ""

    def __str__(self) -> str:
        text = f"{self.check} [{self.kind}]: {self.message}"
        return f"{text}: {self.consequence}" if self.consequence else text


#: What each check's violation does to a training job.
CONSEQUENCES = {
    "gradient_reduce ⊇ data_parallel": (
        "ranks that load different batches never average their gradients, so the model "
        "replicas train apart"
    ),
    "gradient_reduce ⊇ context": (
        "CP peers each compute a partial gradient of the same weights from their piece of the "
        "sequence and nothing sums them, so each steps on part of the gradient and their "
        "weights drift apart"
    ),
    "tensor peers share the data-parallel rank": (
        "TP peers compute one step's shards on different batches"
    ),
    "context peers share the data-parallel rank": (
        "CP peers hold pieces of different sequences, not one sequence split"
    ),
    "pipeline peers share the data-parallel rank": (
        "pipeline stages pass activations of different batches down the pipe"
    ),
    "pipeline neighbours": "activations reach a rank holding another shard",
    "gradient-reduce peers load different batches": (
        "ranks that average gradients were handed the same batch: each step trains on one "
        "batch where the data-parallel degree promised several"
    ),
    "partition": "some rank is in no group of this kind, or in two",
    "expert peers share the pipeline stage": (
        "EP peers on different stages reach their all-to-alls at different points of the "
        "pipeline schedule, so the token exchange pairs calls of different layers or hangs"
    ),
    "expert peers share the expert-data-parallel rank": (
        "a loader sharded over the expert-data-parallel group (how evaluation keeps EP peers "
        "in lockstep when EP > 1) hands EP peers different shards, whose batch counts can "
        "differ: the peer with fewer batches stops while the others wait in the all-to-all"
    ),
}

#: Roles whose local rank every expert-parallel group must share: role -> (check, what differs).
#: EP peers exchange tokens by all-to-all in every MoE layer of every step, so they must run
#: the same steps in lockstep: from the same pipeline stage, and (where a loader shards over
#: the expert-data-parallel group, ModelOpt PR 1966) on the same batch. The dense
#: data-parallel rank is no such role: EP is carved out of it (torchtitan's dp2ep, DeepSpeed,
#: megatron's expert grid), so EP peers load different batches by design.
EXPERT_LOCKSTEP = {
    "pipeline": ("expert peers share the pipeline stage", "pipeline stages"),
    "expert_data": (
        "expert peers share the expert-data-parallel rank",
        "expert-data-parallel ranks",
    ),
}


def is_partition(groups: Groups, world_size: int) -> bool:
    """Every rank ``0..world_size-1`` is in exactly one group."""
    return groups.is_partition_of(world_size)


def _owner(groups: Groups, world_size: int) -> npt.NDArray[np.int64]:
    """Index of the group each rank sits in (-1 when none)."""
    owner = np.full(world_size, -1, dtype=np.int64)
    rows = groups.array
    owner[rows.ravel()] = np.repeat(np.arange(len(groups)), groups.group_size)
    return owner


def uncontained_groups(inner: Groups, outer: Groups, world_size: int) -> Groups:
    """Groups of ``inner`` that do not sit entirely inside one group of ``outer``.

    Example: data-parallel ``(0, 2)`` inside gradient-reduce ``(0, 1, 2, 3)`` is contained.
    Kept with ``inner``: a sweep's layouts pair the same shared families again and again.
    """
    key = ("uncontained", outer.serial, world_size)
    return inner.derived(key, _uncontained_groups, inner, outer, world_size)  # type: ignore[no-any-return]


def _uncontained_groups(inner: Groups, outer: Groups, world_size: int) -> Groups:
    owner = _owner(outer, world_size)
    where = owner[inner.array]
    bad = (where != where[:, :1]).any(axis=1) | (where[:, 0] < 0)
    return Groups.from_array(inner.array[bad])


def is_contained(inner: Groups, outer: Groups, world_size: int) -> bool:
    """Every group of ``inner`` lies inside one group of ``outer``."""
    return len(uncontained_groups(inner, outer, world_size)) == 0


def peers_with_different_local_rank(peers: Groups, reference: Groups, world_size: int) -> Groups:
    """Groups of ``peers`` whose members hold different local ranks in ``reference``.

    TP, CP and PP peers must share their data-parallel local rank: it decides which batch a
    rank loads, and tensor-parallel peers fed different batches train garbage silently.
    Kept with ``peers``, as :func:`uncontained_groups`.
    """
    key = ("local rank differs", reference.serial, world_size)
    return peers.derived(key, _peers_with_different_local_rank, peers, reference, world_size)  # type: ignore[no-any-return]


def _peers_with_different_local_rank(peers: Groups, reference: Groups, world_size: int) -> Groups:
    local = reference.local_ranks(world_size)
    values = local[peers.array]
    bad = (values != values[:, :1]).any(axis=1)
    return Groups.from_array(peers.array[bad])


def same_batch_reducers(expected: Expected) -> Groups:
    """Gradient-reduce groups in which two ranks load the same batch without being context
    peers (which legitimately share a batch and split its sequences).

    A rank's batch is its local rank in the data-parallel partition. Gradient reduction
    averages over ranks that trained on different data: two members with the same batch and
    the same context local rank computed the same gradient, so that part of the reduce buys
    nothing (accelerate's ``DataLoaderDispatcher`` with TP + FSDP hands every rank rank 0's one
    batch). Empty when the data-parallel kind does not partition the world.
    """
    world = expected.world_size
    data_kind = expected.kind(expected.roles["data_parallel"])
    if not data_kind.partition:
        return Groups.from_array(np.empty((0, 1), dtype=np.int64))
    batch = data_kind.groups().local_ranks(world)
    reduce = expected.groups("gradient_reduce")
    rows = reduce.array
    keys = batch[rows]
    if "context" in expected.roles and expected.kind(expected.roles["context"]).partition:
        context = expected.groups("context").local_ranks(world)
        keys = keys * world + context[rows]
    ordered = np.sort(keys, axis=1)
    bad = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1) if rows.shape[1] > 1 else []
    return Groups.from_array(rows[np.asarray(bad, dtype=bool)] if len(bad) else rows[:0])


def expert_lockstep_breaks(expected: Expected) -> dict[str, Groups]:
    """Role -> the expert-parallel groups whose members hold different local ranks in it
    (only roles of :data:`EXPERT_LOCKSTEP` with at least one such group).

    Example: megatron ``ep=2`` on 4 ranks has EP groups ``(0, 1)``, ``(2, 3)`` and expert-DP
    groups ``(0, 2)``, ``(1, 3)``: ranks 0 and 1 are both expert-DP rank 0, so nothing breaks.
    Expert-DP groups ``(0, 2)``, ``(3, 1)`` would give rank 1 expert-DP rank 1 and break it.
    """
    if not _usable(expected, "expert"):
        return {}
    experts = expected.groups("expert")
    if experts.group_size < 2:
        return {}
    out: dict[str, Groups] = {}
    for role in EXPERT_LOCKSTEP:
        if not _usable(expected, role) or not expected.kind(role).partition:
            continue
        bad = peers_with_different_local_rank(experts, expected.groups(role), expected.world_size)
        if len(bad):
            out[role] = bad
    return out


def _usable(expected: Expected, role: str) -> bool:
    """The role is present and its kind's groups can be computed under this config."""
    return role in expected.roles and expected.kind(role).available


def crossing_groups(groups: Groups, gpus_per_node: int) -> Groups:
    """Groups whose members sit on more than one node (node = rank // gpus_per_node).

    A tensor-parallel group that leaves a node is the classic silent slowdown.
    """
    if gpus_per_node < 1:
        raise LayoutError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    nodes = groups.array // gpus_per_node
    if nodes.size == 0:
        return groups
    crossing = nodes.min(axis=1) != nodes.max(axis=1)
    return Groups.from_array(groups.array[crossing])


def node_crossings(expected: Expected, gpus_per_node: int) -> dict[str, Groups]:
    """Kind -> its groups that cross node boundaries (only kinds with at least one)."""
    out = {}
    for kind in expected.kinds():
        crossing = crossing_groups(expected.groups(kind), gpus_per_node)
        if len(crossing):
            out[kind] = crossing
    return out


def pipeline_neighbors_mismatch(expected: Expected) -> list[str]:
    """Pipeline neighbours that differ in more than their stage.

    Consecutive stages of one pipeline must hold the same position in every other
    partitioning role (same tensor, context, data-parallel and expert local rank), or
    activations travel to a rank holding a different shard.
    """
    if "pipeline" not in expected.roles:
        return []
    pipes = expected.groups("pipeline")
    if pipes.group_size < 2:
        return []
    problems = []
    for role in ("tensor", "context", "data_parallel", "expert"):
        if role not in expected.roles:
            continue
        kind = expected.kind(role)
        if not kind.partition:
            continue
        local = kind.groups().local_ranks(expected.world_size)[pipes.array]
        bad = np.flatnonzero((local != local[:, :1]).any(axis=1))
        if bad.size:
            pipe = pipes[int(bad[0])]
            problems.append(
                f"pipeline {pipe} holds {role} local ranks {local[bad[0]].tolist()}; "
                f"neighbours must differ only in their stage"
            )
    return problems


def unreduced_peers(expected: Expected, role: str) -> str:
    """Why some groups of ``role`` (``data_parallel`` or ``context``) are not reduced together,
    or ``""`` when every group lies inside one gradient-reduce group.

    Data-parallel ranks train on different batches and context peers on different pieces of
    one sequence, all with the same weights: their gradients must meet in one reduce. A layout
    with such groups of more than one rank and no ``gradient_reduce`` role at all reduces
    nothing (accelerate's ``MULTI_GPU`` with ``tp_size > 1`` skips DDP); one whose reduce
    groups split them reduces in part (verl's ``fsdp_size=1``: one-rank groups). Nothing is
    said where the convention cannot tell the gradient role (``unknown_roles``).

    Example: data-parallel ``(0, 2)``, ``(1, 3)`` inside gradient-reduce ``(0, 1, 2, 3)`` give
    ``""``; inside ``(0, 1)``, ``(2, 3)`` they are split.
    """
    if not _usable(expected, role) or "gradient_reduce" in expected.unknown_roles:
        return ""
    if "gradient_reduce" in expected.roles and not _usable(expected, "gradient_reduce"):
        return ""  # the framework raises building it: nothing trains, silently or not
    peers = expected.groups(role)
    what = "data-parallel" if role == "data_parallel" else "context-parallel"
    if "gradient_reduce" not in expected.roles:
        if peers.group_size < 2:
            return ""
        return f"{what} groups {format_groups(peers, 3)} are in no gradient-reduce group"
    bad = uncontained_groups(peers, expected.groups("gradient_reduce"), expected.world_size)
    if not len(bad):
        return ""
    return (
        f"{what} groups {format_groups(bad, 3)} are split across "
        f"{expected.roles['gradient_reduce']} groups"
    )


def find_violations(expected: Expected) -> list[Violation]:
    """Run every invariant that applies to ``expected``; empty when all hold."""
    world = expected.world_size
    found: list[Violation] = []
    for name in expected.kinds():
        kind = expected.kind(name)
        if kind.partition and not is_partition(kind.groups(), world):
            found.append(
                Violation("partition", name, "groups do not cover every rank exactly once")
            )

    roles = expected.roles
    for role in ("data_parallel", "context"):
        problem = unreduced_peers(expected, role)
        if problem:
            found.append(Violation(f"gradient_reduce ⊇ {role}", roles[role], problem))
    if "data_parallel" in roles:
        data = expected.groups("data_parallel")
        for role in ("tensor", "context", "pipeline"):
            if role not in roles:
                continue
            bad = peers_with_different_local_rank(expected.groups(role), data, world)
            if len(bad):
                found.append(
                    Violation(
                        f"{role} peers share the data-parallel rank",
                        roles[role],
                        f"groups {format_groups(bad, 3)} load different batches",
                    )
                )
    if "data_parallel" in roles and "gradient_reduce" in roles:
        bad = same_batch_reducers(expected)
        if len(bad):
            found.append(
                Violation(
                    "gradient-reduce peers load different batches",
                    roles["gradient_reduce"],
                    f"groups {format_groups(bad, 3)} hold ranks with the same data-parallel "
                    f"rank in {roles['data_parallel']} that are not context-parallel peers",
                )
            )
    for role, bad in expert_lockstep_breaks(expected).items():
        check, words = EXPERT_LOCKSTEP[role]
        found.append(
            Violation(
                check,
                roles["expert"],
                f"groups {format_groups(bad, 3)} hold different {words} in {roles[role]}",
            )
        )
    for problem in pipeline_neighbors_mismatch(expected):
        found.append(Violation("pipeline neighbours", roles["pipeline"], problem))
    return [replace(v, consequence=CONSEQUENCES.get(v.check, "")) for v in found]


def validate_invariants(expected: Expected) -> None:
    """Raise :class:`LayoutError` listing every broken invariant."""
    found = find_violations(expected)
    if found:
        lines = "\n".join(f"  - {v}" for v in found)
        raise LayoutError(f"{expected!r} breaks {len(found)} invariant(s):\n{lines}")
