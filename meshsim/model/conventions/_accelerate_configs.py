"""The configs the accelerate convention sweeps (``meshsim.layouts(n, "accelerate")``) and those
accelerate refuses, kept apart from the reference so each module has one job.

The sweep keeps what the reference accepts, so the reference hands in its ``expect``: this
module never imports it back (no import circle)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshsim.errors import LayoutError
from meshsim.model.expected import Expected
from meshsim.model.sweep import divisors, ordered_factorizations

__all__ = ["configs", "refused_configs"]

_Expect = Callable[..., Expected]

_KEYS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")


def configs(
    world_size: int, expect: _Expect, distributed_types: Sequence[str], **options: Any
) -> Iterator[dict[str, Any]]:
    """The sweep behind ``accelerate.configs``, which documents it; ``expect`` and
    ``distributed_types`` are the reference's."""
    versions = tuple(options.get("versions", ("1.15", "1.10")))
    candidates: list[dict[str, Any]] = [{}]
    for sizes in ordered_factorizations(world_size, 4):
        base = {k: s for k, s in zip(_KEYS, sizes, strict=True) if s > 1}
        if base:
            candidates.append(base)
        candidates += [{**base, "distributed_type": kind} for kind in distributed_types]
    for size in divisors(world_size)[1:]:
        candidates.append({"sp_size": size})
        candidates.append({"autotp_size": size})
    candidates.append({"dispatch_batches": True})
    for size in divisors(world_size)[1:-1]:
        for dim in ("tp_size", "cp_size"):
            candidates.append(
                {"dp_shard_size": world_size // size, dim: size, "dispatch_batches": True}
            )
    seen: list[dict[str, Any]] = []
    for version in versions:
        for candidate in candidates:
            config = {**candidate, "version": version} if version != "1.15" else candidate
            if config in seen or not _accepted(expect, world_size, config):
                continue
            if version != "1.15" and _same_as_115(expect, world_size, config):
                continue
            seen.append(config)
            yield config


def _accepted(expect: _Expect, world_size: int, config: dict[str, Any]) -> bool:
    try:
        expected = expect(world_size, **config)
    except LayoutError:
        return False
    # An explicit distributed type equal to the default adds nothing.
    kind = config.get("distributed_type")
    if kind is not None:
        default = {k: v for k, v in config.items() if k != "distributed_type"}
        try:
            if expect(world_size, **default).config["distributed_type"] == kind:
                return False
        except LayoutError:
            return True
    return expected is not None


def _same_as_115(expect: _Expect, world_size: int, config: dict[str, Any]) -> bool:
    """1.10 configs are swept only where 1.15 refuses them (the groups are otherwise equal)."""
    try:
        expect(world_size, **{k: v for k, v in config.items() if k != "version"})
    except LayoutError:
        return False
    return True


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs accelerate rejects, each with its exception (``expect`` raises a ``LayoutError``
    with that ``upstream``): a size < 1, TP/CP with pure replication, CP with SP, CP without FSDP,
    FSDP with nothing to shard (1.15), DeepSpeed with a ParallelismConfig (1.10) (all
    ``ValueError``); a total size short of the world (``ValueError``), beyond it or an AutoTP size
    beyond it (``RuntimeError``), a DeepSpeed Ulysses ``sp_size`` beyond it or not dividing
    it (``RuntimeError``, from DeepSpeed's ``initialize_sequence_parallel``), an AutoTP size
    not dividing it (``IndexError`` from DeepSpeed's engine on the ranks its TP mesh leaves
    out); ``sp_size`` in 1.10 (``TypeError``)."""
    n = world_size
    yield {"tp_size": 0}
    yield {"dp_shard_size": -1}
    if n >= 4 and n % 2 == 0:
        yield {"dp_replicate_size": 2, "tp_size": n // 2}
    if n > 1:
        yield {"tp_size": n, "distributed_type": "FSDP"}  # accelerate#3798's config, 1.15
        yield {"dp_replicate_size": n, "distributed_type": "FSDP"}
        yield {"cp_size": n, "distributed_type": "MULTI_GPU"}
        yield {"dp_shard_size": n, "distributed_type": "DEEPSPEED", "version": "1.10"}
    if n > 2:
        yield {"dp_shard_size": n - 1}
    yield {"tp_size": 2 * n}
    yield {"autotp_size": 2 * n}
    if n > 3 and n % 3:
        yield {"autotp_size": 3}  # DeepSpeed's (n // 3, 3) TP mesh leaves ranks out
        yield {"sp_size": 3}  # DeepSpeed's initialize_sequence_parallel: not divisible
    yield {"sp_size": 2 * n}  # ... and beyond the world
    yield {"sp_size": 2, "version": "1.10"}
    yield {"cp_size": 2, "sp_size": 2}
