"""``assert_data_parallel``: prove from what every rank loaded that the loader used the data mesh.

The rules come from the reference's roles: ranks with the same data-parallel rank (TP, CP and
pipeline peers) load the same samples in the same order; the ranks of one data-parallel group
load disjoint samples whose union is the global batch; no sample repeats within an epoch;
expert-parallel peers run the same number of steps (:mod:`meshsim.dataflow.lockstep`). When
a rule breaks, the message names the step, the ranks and the samples, then tries the usual
wiring mistakes against the data and names the one that explains it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from meshsim.dataflow import roles
from meshsim.dataflow.evidence import MeshGroups, require_data_movement, wrong_mesh
from meshsim.dataflow.lockstep import lockstep_problems
from meshsim.dataflow.records import BatchRecord, SampleId, Step
from meshsim.errors import DataflowMismatch, NothingCompared, UsageError
from meshsim.model.expected import Expected

#: How many sample ids a message lists before eliding.
SHOWN = 6


def assert_data_parallel(
    records: BatchRecord | Iterable[BatchRecord],
    expected: Expected,
    *,
    global_batches: Sequence[Iterable[SampleId]] | None = None,
    context_chunks: bool = False,
) -> None:
    """Raise :class:`~meshsim.errors.DataflowMismatch` unless the batches follow ``expected``.

    ``records`` holds every rank's :class:`BatchRecord` (what ``meshsim.run`` returned from a
    body ending in ``return meshsim.record_batches(...)``), in any order. Inside a running rank,
    pass this rank's record alone: it is all-gathered over the world first (collective).
    ``global_batches`` (sample ids per step) adds the check that each data-parallel group's
    union is exactly that batch. ``context_chunks=True`` says the context-parallel peers hold
    different sequence chunks of the same samples (recorded with ``chunk=``) and checks it.
    Expert-parallel peers (the ``expert`` role) must record the same number of steps, or their
    all-to-all hangs; that finding leads. A reference that cannot tell the data-parallel groups
    raises :class:`~meshsim.errors.RolesUnknown` (pass ``roles=``); records with no two ranks to
    compare (one rank, or no step recorded) raise :class:`~meshsim.errors.NothingCompared`.
    """
    roles.require_known(expected, "data_parallel")
    gathered = _gather(records)
    by_rank = _by_rank(gathered, expected.world_size)
    problems = find_problems(
        by_rank,
        expected,
        global_batches=global_batches,
        context_chunks=context_chunks,
        mesh_groups={r.rank: r.mesh_groups for r in gathered},
    )
    if problems:
        raise DataflowMismatch(problems, what="the batches the ranks loaded")


def find_problems(
    by_rank: dict[int, list[Step]],
    expected: Expected,
    *,
    global_batches: Sequence[Iterable[SampleId]] | None = None,
    context_chunks: bool = False,
    mesh_groups: MeshGroups | None = None,
) -> list[str]:
    """Every broken rule, one line each, in step order (the first is the one to fix first).

    ``mesh_groups`` (rank -> the mesh groups it held) lets a hint blame a wrong mesh instead of
    a loader that followed it."""
    lockstep = lockstep_problems(by_rank, expected)
    if lockstep:  # the EP group names the all-to-all that hangs; the world count says less
        return lockstep
    counts = {r: len(steps) for r, steps in by_rank.items()}
    if len(set(counts.values())) > 1:
        most = max(counts.values())
        short = sorted(r for r, n in counts.items() if n < most)
        return [
            f"ranks {roles.ranks_list(short)} recorded fewer steps than the others "
            f"({', '.join(f'rank {r}: {counts[r]}' for r in short[:4])}; the most is {most}): "
            "uneven shards make the ranks with more batches hang in their next collective "
            "(use drop_last=True or pad the dataset)"
        ]
    steps = next(iter(counts.values()), 0)
    if global_batches is not None and len(global_batches) != steps:
        raise UsageError(f"global_batches has {len(global_batches)} entries for {steps} steps")
    if context_chunks and any(s.chunk is None for ss in by_rank.values() for s in ss):
        raise UsageError(
            "context_chunks=True needs every step recorded with chunk= (the part of each "
            "sequence the rank holds)"
        )
    index = roles.data_index(expected)
    replicas: dict[int, list[int]] = {}
    for rank in sorted(by_rank):
        replicas.setdefault(index[rank], []).append(rank)
    why = _nothing_compared(steps, replicas, roles.data_groups(expected))
    if why:
        raise NothingCompared(why)
    problems: list[str] = []
    reported: set[tuple[int, int]] = set()
    mesh = wrong_mesh(mesh_groups or {}, expected)
    for step in range(steps):
        at = {r: by_rank[r][step] for r in by_rank}
        found = _replicas_agree(step, at, replicas, expected, context_chunks, by_rank, mesh)
        for pair, problem in found:
            if pair not in reported:  # a pair that differs once usually differs every step
                reported.add(pair)
                problems.append(problem)
        problems += _shards_disjoint(step, at, expected, global_batches, mesh)
    problems += _no_repeats(by_rank, replicas)
    return problems


def _nothing_compared(
    steps: int, replicas: dict[int, list[int]], groups: list[tuple[int, ...]]
) -> str | None:
    """Why no rule compared two ranks (None when one did): no step, or no pair at all."""
    if steps == 0:
        return (
            "assert_data_parallel compared nothing: no rank recorded a step (rec.add(batch) "
            "once per step, or record_batches(batches)); nothing was checked, which is not a pass"
        )
    if all(len(r) < 2 for r in replicas.values()) and all(len(g) < 2 for g in groups):
        return (
            "assert_data_parallel compared nothing: no two ranks share a data-parallel rank or "
            "a data-parallel group (a world of one rank); nothing was checked, which is not a pass"
        )
    return None


def _gather(records: BatchRecord | Iterable[BatchRecord]) -> list[BatchRecord]:
    if isinstance(records, BatchRecord):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError(
                "assert_data_parallel got one rank's record outside a run; pass the records of "
                "every rank (what meshsim.run returned)"
            )
        require_data_movement("assert_data_parallel(record, ...) inside a rank")
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        return gathered
    out = list(records)
    for item in out:
        if not isinstance(item, BatchRecord):
            raise UsageError(
                f"records must be BatchRecord objects (return meshsim.record_batches(...) from "
                f"each rank), got {type(item).__name__}"
            )
    return out


def _by_rank(records: list[BatchRecord], world_size: int) -> dict[int, list[Step]]:
    by_rank: dict[int, list[Step]] = {}
    for record in records:
        if record.rank in by_rank:
            raise UsageError(f"two records for rank {record.rank}")
        if record.rank >= world_size:
            raise UsageError(f"a record for rank {record.rank}, outside world size {world_size}")
        by_rank[record.rank] = list(record.steps)
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        raise UsageError(f"no record for ranks {roles.ranks_list(missing)}")
    return by_rank


def _ids(samples: Iterable[SampleId]) -> str:
    items = list(samples)
    text = ", ".join(repr(s) for s in items[:SHOWN])
    return f"[{text}{', ...' if len(items) > SHOWN else ''}]"


def _replicas_agree(
    step: int,
    at: dict[int, Step],
    replicas: dict[int, list[int]],
    expected: Expected,
    context_chunks: bool,
    by_rank: dict[int, list[Step]],
    mesh: str | None,
) -> list[tuple[tuple[int, int], str]]:
    """Ranks of one data-parallel rank: same samples; chunks per ``context_chunks``."""
    for dp_rank, ranks in replicas.items():
        first = ranks[0]
        for other in ranks[1:]:
            a, b = at[first], at[other]
            peers = roles.relation(expected, first, other)
            if a.samples != b.samples:
                head = (
                    f"step {step}: ranks {first} and {other} are {peers} (same data-parallel "
                    f"rank {dp_rank}) but loaded different samples: rank {first} "
                    f"{_ids(a.samples)}, rank {other} {_ids(b.samples)}"
                )
                why = mesh or _why_replicas(at, expected, first, other, by_rank)
                return [((first, other), head + ". Likely mistake: " + why)]
        problem = _chunks_agree(step, at, ranks, expected, context_chunks)
        if problem:
            return [((-1, step), problem)]
    return []


def _chunks_agree(
    step: int, at: dict[int, Step], ranks: list[int], expected: Expected, context_chunks: bool
) -> str | None:
    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            ca, cb = at[a].chunk, at[b].chunk
            if ca is None or cb is None:
                continue
            cp_peers = roles.relation(expected, a, b) == "CP peers" or _differ_in_cp(expected, a, b)
            if context_chunks and cp_peers and ca == cb:
                return (
                    f"step {step}: CP peers {a} and {b} hold the same chunk {ca!r} of samples "
                    f"{_ids(at[a].samples)}: the sequence was not split over the context-"
                    "parallel group (each CP rank must take its own chunk)"
                )
            if not cp_peers and ca != cb:
                return (
                    f"step {step}: ranks {a} and {b} are {roles.relation(expected, a, b)} in the "
                    f"same context-parallel position but hold different chunks ({ca!r} vs "
                    f"{cb!r}) of samples {_ids(at[a].samples)}"
                )
    return None


def _differ_in_cp(expected: Expected, a: int, b: int) -> bool:
    """True when ``a`` and ``b`` sit at different context-parallel positions."""
    if "context" not in expected.roles:
        return False
    return expected.local_rank(a, "context") != expected.local_rank(b, "context")


def _why_replicas(
    at: dict[int, Step], expected: Expected, a: int, b: int, by_rank: dict[int, list[Step]]
) -> str:
    """Name the wiring that produces exactly this step's data, or describe the symptom."""
    data_kind = expected.roles.get("data_parallel")
    for kind, groups in roles.partitions(expected):
        if kind == data_kind or len(groups[0]) <= 1 or not _split_over(at, groups):
            continue
        peers = roles.relation(expected, a, b)
        wanted = roles.describe_kind(expected, data_kind) if data_kind else "no group (DP = 1)"
        what = "the gradient group " if kind == expected.roles.get("gradient_reduce") else ""
        return (
            f"the sampler was split over {what}{roles.describe_kind(expected, kind)} instead of "
            f"the data-parallel group {wanted}, so {peers} {a} and {b} got different samples"
        )
    sa = {s for step in by_rank[a] for s in step.samples}  # over every step: a shuffle with
    sb = {s for step in by_rank[b] for s in step.samples}  # another seed overlaps somewhere
    if sa & sb:
        return (
            f"ranks {a} and {b} drew from the same shard in a different order or selection: their "
            "samplers/loaders use different random seeds (seed every rank the same; only the "
            "data-parallel rank may change which samples a rank gets)"
        )
    return (
        f"ranks {a} and {b} got disjoint samples: the sampler was split over a group that "
        f"includes {roles.relation(expected, a, b)} (num_replicas/rank must come from the data-"
        "parallel group only)"
    )


def _split_over(at: dict[int, Step], groups: list[tuple[int, ...]]) -> bool:
    """Would a sampler split over ``groups`` give exactly this step's samples?"""
    by_position: dict[int, tuple[SampleId, ...]] = {}
    for group in groups:
        seen: set[SampleId] = set()
        for position, rank in enumerate(group):
            samples = at[rank].samples
            if seen & set(samples):
                return False
            seen |= set(samples)
            if by_position.setdefault(position, samples) != samples:
                return False
    return True


def _shards_disjoint(
    step: int,
    at: dict[int, Step],
    expected: Expected,
    global_batches: Sequence[Iterable[SampleId]] | None,
    mesh: str | None,
) -> list[str]:
    for group in roles.data_groups(expected):
        owner: dict[SampleId, int] = {}
        for rank in group:
            for sample in at[rank].samples:
                if sample in owner and owner[sample] != rank:
                    return [_overlap(step, at, expected, group, owner[sample], rank, mesh)]
                owner[sample] = rank
        if global_batches is not None:
            wanted = set(global_batches[step])
            got = set(owner)
            if got != wanted:
                missing, extra = sorted(wanted - got, key=repr), sorted(got - wanted, key=repr)
                return [
                    f"step {step}: data-parallel group ({roles.ranks_list(group)}) loaded "
                    f"{len(got)} samples, not the global batch of {len(wanted)}: missing "
                    f"{_ids(missing)}, unexpected {_ids(extra)}"
                ]
    return []


def _overlap(
    step: int,
    at: dict[int, Step],
    expected: Expected,
    group: tuple[int, ...],
    a: int,
    b: int,
    mesh: str | None,
) -> str:
    both = [s for s in at[a].samples if s in set(at[b].samples)]
    head = (
        f"step {step}: data-parallel ranks {a} and {b} (group {roles.ranks_list(group)}) both "
        f"loaded samples {_ids(both)}"
    )
    if mesh:
        return head + ". Likely mistake: " + mesh
    if all(at[r].samples == at[group[0]].samples for r in group):
        return head + (
            ". Likely mistake: the sampler was not split over the data-parallel group (every "
            "rank of the group loaded the same batch: num_replicas/rank not passed, or taken "
            "from a group of size 1)"
        )
    smaller = _split_within(at, expected)
    if smaller:
        return head + (
            f". Likely mistake: the sampler was split over {smaller} instead of the data-"
            f"parallel group {roles.describe_kind(expected, expected.roles['data_parallel'])}, "
            f"so data-parallel ranks {a} and {b} loaded the same samples"
        )
    return head + ": data-parallel ranks must load disjoint samples"


def _split_within(at: dict[int, Step], expected: Expected) -> str | None:
    """The kind a sampler split over would give exactly this step's samples (a part of the
    data-parallel group: ``dp_shard`` alone under HSDP), described; None if no kind does."""
    data_kind = expected.roles.get("data_parallel")
    for kind, groups in roles.partitions(expected):
        if kind in (data_kind, "<world>") or len(groups[0]) <= 1:
            continue
        if _split_over(at, groups):
            return roles.describe_kind(expected, kind)
    return None


def _no_repeats(by_rank: dict[int, list[Step]], replicas: dict[int, list[int]]) -> list[str]:
    """Within an epoch no sample comes back, on the same rank or another data-parallel rank."""
    first_seen: dict[tuple[int, SampleId], tuple[int, int]] = {}
    for dp_rank in sorted(replicas):
        rank = replicas[dp_rank][0]
        for step, record in enumerate(by_rank[rank]):
            for sample in record.samples:
                key = (record.epoch, sample)
                if key in first_seen and first_seen[key][1] != step:
                    other, before = first_seen[key]
                    return [
                        f"sample {sample!r} loaded twice in epoch {record.epoch}: by rank "
                        f"{other} at step {before} and by rank {rank} at step {step}. Likely "
                        "mistake: the sampler restarts its order within the epoch (a new "
                        "sampler/iterator per step, or set_epoch not called between epochs)"
                    ]
                first_seen[key] = (rank, step)
    return []
