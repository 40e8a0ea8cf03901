"""Which blocked ranks can never leave the call they are in: their recordings are final.

A rank blocked in a collective leaves it only when every member of the group makes the same
call at the same position of that group's sequence. When a run is stopped (a deadline, a
peer's crash) or seems to stand still, the harness asks which ranks can still move:

* a rank computing outside any recorded call may make any call next;
* a rank whose call every member has already made (the same call, same position) will
  leave it, and so may make any call after it;
* a rank waiting for a member that may still move may be released by it.

The rest are deadlocked: nothing they wait for can happen, so they will make no call after
the one they are in, and ``meshsim.harness.divergence`` may treat a call they lack as never
made. What a call waits for is modelled only where it is certain, and counted as able to
move otherwise (conservative: a missed deadlock costs time, a false one a false report):

* a creation waits for the new group's members (non-members return at once);
* a blocking ``recv`` from one peer waits for that peer's matching send; a ``send`` waits
  only for a peer that returned without receiving it (otherwise it may be buffered);
* async calls (``async_op=True``, functional collectives), rooted collectives (broadcast,
  scatter, gather, reduce: a non-root waits for the root alone), receives from any source,
  ``batch_isend_irecv`` and waits on a ``Work`` outside any recorded call count as moving.

``returned``: ranks that returned. A rank that raised or died is neither: for the final set
(``returned`` given) it counts as able to move, since what it would have called is unknown;
for a standstill (``returned=None``) it releases nobody.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from meshsim.harness.divergence import _key
from meshsim.harness.recorder import Call

#: The slot of world-synchronised creations (every rank makes them, in order).
WORLD_CREATIONS = ("world-synchronised creations",)


def slot_of(rank: int, call: Call) -> object | None:
    """Which ordered sequence ``call`` belongs to on ``rank``; ``None`` if it is not collective.

    ``WORLD_CREATIONS`` for a creation every rank makes, the group's ranks for a collective or
    a member-only creation (``None`` group: the world), ``None`` for point-to-point calls and
    for a member-only creation on a rank outside the group (a no-op there).
    """
    if call.kind == "p2p":
        return None
    if call.kind == "create" and not call.local:
        return WORLD_CREATIONS
    if call.kind == "create" and call.group is not None and rank not in call.group:
        return None
    return call.group if call.group is not None else "world"


def members(slot: object, world_size: int) -> Sequence[int]:
    if slot is WORLD_CREATIONS or slot == "world":
        return range(world_size)
    return slot  # type: ignore[return-value]


#: Collectives whose non-root ranks wait for the root alone (or not at all).
ROOTED = frozenset(
    (
        "broadcast",
        "scatter",
        "gather",
        "reduce",
        "broadcast_object_list",
        "scatter_object_list",
        "gather_object",
    )
)


def deadlocked(
    world_size: int,
    calls: Mapping[int, Sequence[Call]],
    blocked: Mapping[int, Call | None],
    returned: Collection[int] | None = None,
) -> set[int]:
    """The ranks in ``blocked`` (running rank -> the call it is inside, or ``None``) that can
    never leave their call, given every rank's recorded ``calls`` so far (see above)."""
    projections: dict[int, dict[object, list[Call]]] = {}
    for rank, sequence in calls.items():
        per_slot: dict[object, list[Call]] = {}
        for call in sequence:
            slot = slot_of(rank, call)
            if slot is not None:
                per_slot.setdefault(slot, []).append(call)
        projections[rank] = per_slot

    def made(rank: int, slot: object) -> list[Call]:
        return projections.get(rank, {}).get(slot, [])

    ended = set(range(world_size)) - set(blocked)
    moving: set[int] = set() if returned is None else ended - set(returned)
    waits: dict[int, list[int]] = {}  # blocked rank -> the ranks it waits for
    for rank, call in blocked.items():
        sequence = calls.get(rank, ())
        if call is None or not sequence or sequence[-1] is not call or call.async_op:
            moving.add(rank)  # computing, or not inside the call its recording ends with
            continue
        slot = slot_of(rank, call)
        if slot is None:
            peer = _p2p_peer_awaited(rank, call, calls, returned)
            if peer is None:
                moving.add(rank)
            else:
                waits[rank] = [peer]
            continue
        if call.op in ROOTED:
            moving.add(rank)
            continue
        index = len(made(rank, slot)) - 1
        peers = members(slot, world_size)
        if slot is WORLD_CREATIONS and call.op == "new_group" and call.group is not None:
            peers = call.group
        missing = [
            m
            for m in peers
            if len(made(m, slot)) <= index or _key(made(m, slot)[index]) != _key(call)
        ]
        if missing:
            waits[rank] = [m for m in missing if len(made(m, slot)) <= index]
        else:
            moving.add(rank)  # everyone is there: the call completes
    changed = True
    while changed:
        changed = False
        for rank, awaited in list(waits.items()):
            if any(m in moving for m in awaited):
                moving.add(rank)
                del waits[rank]
                changed = True
    return set(waits)


def _p2p_peer_awaited(
    rank: int,
    call: Call,
    calls: Mapping[int, Sequence[Call]],
    returned: Collection[int] | None,
) -> int | None:
    """The peer a blocking one-peer ``send``/``recv`` still waits for; ``None`` if it will
    complete, may be buffered, or is a kind of call this analysis does not follow."""
    if call.op not in ("send", "recv", "send_object_list", "recv_object_list"):
        return None
    if len(call.ops) != 1 or call.ops[0].peer is None:
        return None
    op = call.ops[0]
    if op.sends and (returned is None or op.peer not in returned):
        return None  # a send completes once buffered; only a peer that returned never takes it
    if op.sends and any(
        not p.sends and p.peer is None for c in calls.get(op.peer, ()) for p in c.ops
    ):
        return None  # the peer receives from any source: not followed
    mine = _channel_ops(calls.get(rank, ()), op.peer, op.sends, op.tag)
    theirs = _channel_ops(calls.get(op.peer, ()), rank, not op.sends, op.tag)
    return None if theirs >= mine else op.peer


def _channel_ops(sequence: Sequence[Call], peer: int, sends: bool, tag: int) -> int:
    """How many messages ``sequence`` sent to (``sends``) or received from ``peer`` on ``tag``."""
    return sum(
        1 for c in sequence for p in c.ops if p.sends == sends and p.peer == peer and p.tag == tag
    )
