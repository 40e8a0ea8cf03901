"""A layout's groups, kind names aside, as one short digest: the key a sweep uses to prove each
distinct group structure once.

Many configs of a world build the very same groups under other names or other spellings:
megatron's ``order`` strings that differ only in where degree-1 dims sit, ``tp=2`` and
``cp=2`` meshes whose only non-trivial groups are the same pairs, a ``hyper_comm_grid`` that
restates a default. Proving by all-gather that groups of those ranks communicate is the same
work for each of them, so a sweep proves it once per fingerprint (``meshsim.cli.sweep``).
What differs between such configs, the framework's code path, is still run for every one of
them, on the fake tier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from meshsim.model.expected import Expected, Kind
from meshsim.model.groups import Groups


def group_fingerprint(expected: Expected, kinds: Sequence[Kind] | None = None) -> str:
    """A digest of every kind's families of groups (rows in canonical order, with the
    backends, the sub-mesh shape and whether the family covers the world), as a set: kind
    names are left out, and so are derived kinds (no process group has them) and kinds the
    framework refuses.

    Two layouts with the same fingerprint build the same families of process groups; one may
    call a family ``tp`` where the other calls it ``cp``. ``kinds``: ``process_group_kinds
    (expected)`` where the caller has it already.
    """
    parts: list[bytes] = []
    seen: set[tuple[object, ...]] = set()
    for kind in process_group_kinds(expected) if kinds is None else kinds:
        groups = kind.groups()
        # Kinds often share one family object (torchtitan's ~230 getters, ~60 views).
        same = (id(groups), kind.partition, kind.keyed_by_first, kind.mesh_shape, kind.backends)
        if same in seen:
            continue
        seen.add(same)
        about = (kind.partition, kind.keyed_by_first, *_dims(kind))
        parts.append(groups.derived(("fingerprint", about), _family_digest, groups, about))
    total = hashlib.blake2b(digest_size=12)
    total.update(str(expected.world_size).encode())
    for part in sorted(set(parts)):
        total.update(part)
    return total.hexdigest()


def _family_digest(groups: Groups, about: tuple[object, ...]) -> bytes:
    rows = groups.canonical()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((rows.shape, *about)).encode())
    digest.update(rows.astype("<i8", copy=False).tobytes())
    return digest.digest()


def process_group_kinds(expected: Expected) -> list[Kind]:
    """The kinds some process group has: neither derived nor refused by the framework."""
    kinds = (expected.kind(name) for name in expected.kinds())
    return [kind for kind in kinds if kind.available and not kind.derived]


def _dims(kind: Kind) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """The kind's sub-mesh shape and per-dim backends without its size-1 dims: a ``(2, 1)``
    mesh makes the same process groups as a ``(2,)`` one, plus groups of one rank."""
    shape, backends = kind.mesh_shape, kind.backends
    if not shape or len(backends) not in (0, len(shape)):
        return shape, backends
    kept = [i for i, size in enumerate(shape) if size != 1]
    return tuple(shape[i] for i in kept), tuple(backends[i] for i in kept) if backends else ()
