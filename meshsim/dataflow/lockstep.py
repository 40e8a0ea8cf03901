"""Expert-parallel peers in lockstep: every member of an EP group ran the same number of steps.

EP peers exchange tokens by all-to-all in every MoE layer of every step, so one that runs a
step its peers never run waits in that all-to-all until the job times out. The usual cause is
an evaluation set sharded over the dense data-parallel group with EP > 1: EP peers are
different data-parallel ranks, so an uneven split hands them different batch counts (NVIDIA
Model-Optimizer PR 1966, a 600 s NCCL timeout). Read off the reference's ``expert`` role.
"""

from __future__ import annotations

from meshsim.dataflow import roles
from meshsim.dataflow.records import Step
from meshsim.model.expected import Expected

#: The mistake named when EP peers with different data-parallel ranks ran different counts.
DENSE_SHARDING = (
    "evaluation sharded over the dense data-parallel group with EP > 1: EP peers must run the "
    "same number of steps or the all-to-all hangs"
)


def expert_groups(expected: Expected) -> list[tuple[int, ...]]:
    """The expert-parallel groups of two or more ranks; none when the layout has no EP, the
    reference cannot tell it, or this config cannot build it."""
    if "expert" not in expected.roles or not expected.kind("expert").available:
        return []
    return [tuple(g) for g in expected.groups("expert") if len(g) > 1]


def lockstep_problems(by_rank: dict[int, list[Step]], expected: Expected) -> list[str]:
    """One line for the first EP group whose members recorded different step counts (naming
    how many more groups do too); empty when every EP group ran in lockstep.

    Example: megatron ``ep=2`` on 4 ranks, 7 evaluation samples split over the data-parallel
    group ``(0, 1, 2, 3)``: ranks 0-2 get 2 batches, rank 3 gets 1, and EP group ``(2, 3)``
    breaks: rank 2's second all-to-all has no partner.
    """
    uneven = [
        group for group in expert_groups(expected) if len({len(by_rank[r]) for r in group}) > 1
    ]
    if not uneven:
        return []
    group = uneven[0]
    counts = {r: len(by_rank[r]) for r in group}
    fewest = min(counts.values())
    ahead = [r for r in group if counts[r] > fewest]
    behind = [r for r in group if counts[r] == fewest]
    shown = ", ".join(f"rank {r}: {counts[r]}" for r in group[:8])
    more = f", ... {len(group) - 8} more" if len(group) > 8 else ""
    others = len(uneven) - 1
    also = f"; {others} more expert-parallel group{'s' if others > 1 else ''} too" if others else ""
    head = (
        f"expert-parallel group ({roles.ranks_list(group)}) of {expected.roles['expert']} ran out "
        f"of lockstep: its ranks recorded different step counts ({shown}{more}){also}; at step "
        f"{fewest} {_ranks(ahead)} {_verb(ahead, 'waits', 'wait')} in an "
        f"all-to-all that {_ranks(behind)} never {_verb(behind, 'enters', 'enter')}"
    )
    return [f"{head}. Likely mistake: {_why(expected, group, counts)}"]


def _why(expected: Expected, group: tuple[int, ...], counts: dict[int, int]) -> str:
    """Dense data-parallel sharding when the uneven peers hold different data-parallel ranks
    (each loads its own shard); otherwise the loop itself depends on the rank."""
    data_rank = roles.data_index(expected)
    if any(counts[a] != counts[b] and data_rank[a] != data_rank[b] for a in group for b in group):
        edp = expected.roles.get("expert_data")
        over = f" ({edp})" if edp else ""
        return (
            f"{DENSE_SHARDING} (shard over the expert-data-parallel group{over} instead: EP "
            "peers share its rank, so they take the same batches; or make the shards even: "
            "drop_last=True or pad the dataset)"
        )
    return (
        "EP peers with the same data-parallel rank load the same batches, so their loop ran a "
        "different number of times: a step count or early exit that depends on the rank (EP "
        "peers must run the same number of steps or the all-to-all hangs)"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {roles.ranks_list(ranks)}"


def _verb(ranks: list[int], one: str, several: str) -> str:
    return several if len(ranks) > 1 else one
