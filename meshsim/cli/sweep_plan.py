"""What a sweep runs where, once the reference has examined every layout: each distinct group
structure on the asked tier and every rank, the layouts that repeat one on a few fake ranks,
samples on the communicating tiers, and a rough estimate of the cost before it starts.

Many layouts of a world build the same process groups under other names (megatron orders that
move degree-1 dims, a ``cp=2`` mesh and a ``tp=2`` one): the live proof of those groups is
the same work each time, so it is done once per group fingerprint
(``meshsim.model.fingerprint``). The framework's code for every other layout still runs, and
is still diffed against that layout's own reference, on the ranks :func:`sample_ranks`
picks, on the fake tier. ``--exhaustive`` builds every layout on every rank instead, and
``--real`` does so too (:func:`repeats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshsim.model.sweep import LayoutCase

#: The live tiers a ``--communicate`` sample and ``--cross-check`` add.
COMMUNICATING = ("threaded", "gloo")
#: Above this many ranks a sweep's default tier is the reference alone: a live build of every
#: layout would take days (``--backend fake --sample N`` or ``--budget S`` run live ones).
LIVE_DEFAULT_MAX_WORLD = 256
#: Rough seconds per process group a rank creates, per tier, on a 2-core machine
#: (benchmarks/sweep_throughput.py), and per layout besides: the basis of the estimate.
SECONDS_PER_GROUP = {"fake": 60e-6, "threaded": 250e-6, "gloo": 1.5e-3, "nccl": 5e-3}
SECONDS_PER_LAYOUT = {"fake": 0.01, "threaded": 0.05, "gloo": 0.15, "nccl": 0.5}


@dataclass(frozen=True)
class Step:
    """Layouts (indices into the sweep's cases) to build on one tier; ``ranks``: only these
    ranks build each (the fake tier), None: every rank."""

    tier: str
    indices: list[int]
    ranks: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        """The tier as tables and progress lines name it."""
        if self.ranks is None:
            return self.tier
        return f"{self.tier} on ranks {','.join(map(str, self.ranks))}"


def sample_ranks(world_size: int) -> tuple[int, ...] | None:
    """The ranks that build a layout whose group structure another layout proves on every
    rank: the first, the middle and the last (None where that is every rank)."""
    ranks = tuple(sorted({0, world_size // 2, world_size - 1}))
    return None if len(ranks) >= world_size else ranks


def distinct(
    cases: Sequence[LayoutCase], fingerprints: Sequence[str | None], indices: Sequence[int]
) -> tuple[list[int], dict[int, int]]:
    """The first layout of ``indices`` with each (framework, fingerprint), and for each other
    layout the index of the first one that builds its groups. A layout without a fingerprint
    (the reference refused it) is its own representative."""
    first: dict[tuple[str, str], int] = {}
    representatives: list[int] = []
    shares: dict[int, int] = {}
    for index in indices:
        fingerprint = fingerprints[index]
        if fingerprint is None:
            representatives.append(index)
            continue
        key = (cases[index].framework, fingerprint)
        if key in first:
            shares[index] = first[key]
        else:
            first[key] = index
            representatives.append(index)
    return representatives, shares


def spaced(cases: Sequence[LayoutCase], indices: Sequence[int], per_framework: int) -> list[int]:
    """``per_framework`` evenly spaced layouts of each framework among ``indices`` (first and
    last kept), in order."""
    by_framework: dict[str, list[int]] = {}
    for index in indices:
        by_framework.setdefault(cases[index].framework, []).append(index)
    chosen: list[int] = []
    for listed in by_framework.values():
        k = min(per_framework, len(listed))
        if k == 1:
            chosen.append(listed[0])
        elif k > 1:
            chosen += sorted({listed[round(i * (len(listed) - 1) / (k - 1))] for i in range(k)})
    return sorted(chosen)


def repeats(args: Any, shares: dict[int, int]) -> dict[int, int]:
    """The repeats of ``shares`` to build on fake ranks: none under ``--exhaustive`` or
    ``--cross-check``, nor under ``--real``: the fake tier cannot run all of a framework's own
    code (megatron makes gloo groups, a torch assertion there) nor observe it all
    (accelerate's and transformers' adapters find the data-loading peers by communicating),
    so those are built in full on the asked tier, each like a layout of its own."""
    if getattr(args, "exhaustive", False) or args.cross_check or args.real:
        return {}
    return shares


def live_steps(
    args: Any, cases: Sequence[LayoutCase], kept: Sequence[int], shares: dict[int, int]
) -> list[Step]:
    """The live steps after the reference step, in run order, over the layouts ``kept``
    (``--within-node`` left the others out). ``shares`` maps each layout that repeats a group
    structure to the layout that proves it (empty with ``--exhaustive``).

    The repeats are built on the fake tier on :func:`sample_ranks` (those :func:`repeats`
    keeps)."""
    if args.backend == "reference":
        return []
    if args.cross_check:
        return [Step(tier, list(kept)) for tier in ("fake", *COMMUNICATING)]
    shares = repeats(args, shares)
    representatives = [i for i in kept if i not in shares]
    members = [i for i in kept if i in shares]
    if args.sample:
        representatives = spaced(cases, representatives, args.sample)
        members = []
    steps = [Step(args.backend, representatives)]
    if members:
        world = cases[members[0]].world_size
        steps.append(Step("fake", members, sample_ranks(world)))
    if args.communicate:
        chosen = spaced(cases, representatives, args.communicate)
        steps += [Step(tier, chosen) for tier in COMMUNICATING if tier != args.backend]
    return [step for step in steps if step.indices]


def estimate(steps: Sequence[Step], world_size: int, groups: Sequence[int], jobs: int) -> float:
    """Rough wall seconds of ``steps``: each rank creates every group of its layout (most
    frameworks do), at :data:`SECONDS_PER_GROUP` each, plus a fixed cost per layout; the fake
    and threaded tiers run ``jobs`` layouts side by side."""
    total = 0.0
    for step in steps:
        ranks = world_size if step.ranks is None else len(step.ranks)
        per_group = SECONDS_PER_GROUP.get(step.tier, 0.0)
        fixed = SECONDS_PER_LAYOUT.get(step.tier, 0.0)
        seconds = sum(ranks * groups[i] * per_group + fixed for i in step.indices)
        side_by_side = jobs if step.tier in ("fake", "threaded") else 1
        total += seconds / max(1, min(side_by_side, len(step.indices)))
    return total
