"""Match every rank's point-to-point sends to receives after a run, and name the first mismatch.

Collectives are compared rank against rank, but a ``send`` pairs with a ``recv`` on another
rank, so point-to-point calls get their own check. Each call's messages (one for ``send`` /
``isend`` / ``recv`` / ``irecv`` / ``*_object_list``, one per op of ``batch_isend_irecv``)
are put on a channel (source, destination, tag), and the k-th send on a channel must meet the
k-th receive there with the same number of elements and dtype (gloo and NCCL move bytes: a
receive buffer of another *shape* but the same size is fine). What real backends do with a
mismatch varies: gloo silently fills part of a larger buffer, aborts on a smaller one, lets an
``isend`` nobody receives vanish and hangs on a ``recv`` nobody sends; so the harness checks
the recordings itself.

A receive from any source (``src=None``) is matched leniently: on the destination and tag it
listens to, sends are only counted (which send it took is unknown), never size-compared.
Channels to a rank that was not run (``ranks=`` on the fake tier) are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from meshsim.harness.peer import PeerOp
from meshsim.harness.peer import peer_ops as peer_ops
from meshsim.harness.recorder import Call
from meshsim.harness.sites import Site, format_site

Step = tuple[int, Call]


# ---------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class Message:
    """A ``PeerOp`` with the rank and step (position in its recorded sequence) that made it,
    and the user's line that made the call (``site``, for reports)."""

    rank: int
    step: int
    op: PeerOp
    site: Site | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Mismatch:
    """The first bad message on a channel: ``send``/``recv`` is ``None`` for the missing side."""

    src: int
    dst: int
    tag: int
    index: int
    problem: str
    send: Message | None
    recv: Message | None

    def first_step(self) -> int:
        return min(m.step for m in (self.send, self.recv) if m is not None)


Channel = tuple[int, int, int]  # (src, dst, tag)


def _messages(
    calls: Mapping[int, Sequence[Step]],
) -> tuple[dict[Channel, list[Message]], dict[Channel, list[Message]], dict[tuple, list]]:
    """Sends and receives per channel, and receives from any source per (dst, tag)."""
    sends: dict[Channel, list[Message]] = {}
    recvs: dict[Channel, list[Message]] = {}
    anysource: dict[tuple[int, int], list[Message]] = {}
    for rank, steps in calls.items():
        for step, call in steps:
            for op in call.ops:
                msg = Message(rank, step, op, call.site)
                if op.sends and op.peer is not None:
                    sends.setdefault((rank, op.peer, op.tag), []).append(msg)
                elif op.peer is None:
                    anysource.setdefault((rank, op.tag), []).append(msg)
                else:
                    recvs.setdefault((op.peer, rank, op.tag), []).append(msg)
    return sends, recvs, anysource


def _pair_problem(send: PeerOp, recv: PeerOp) -> str | None:
    """Why this send cannot fill this receive, or ``None``."""
    if send.family != recv.family:
        return "a tensor message meets an object-list call"
    if send.shape is None or recv.shape is None:
        return None
    if send.dtype != recv.dtype:
        return "the dtypes differ"
    if math.prod(send.shape) != math.prod(recv.shape):
        return "the sizes differ"
    return None


def mismatches(
    calls: Mapping[int, Sequence[Step]],
    world_size: int,
    *,
    final: Collection[int] | None = None,
) -> list[Mismatch]:
    """Every channel's first mismatch between the recorded ranks ``calls`` (rank -> p2p steps).

    ``final``: the ranks whose recordings are complete (default: all). A missing send or
    receive is a mismatch only when the rank that should have made it is final; a pair whose
    sizes or dtypes differ is one whatever became of the ranks.
    """
    sends, recvs, anysource = _messages(calls)
    recorded = set(calls)
    done = recorded if final is None else recorded & set(final)
    found: list[Mismatch] = []
    surplus: dict[tuple[int, int], list[Message]] = {}
    for channel in sorted(set(sends) | set(recvs)):
        src, dst, tag = channel
        if src not in recorded or dst not in recorded:
            continue
        lenient = (dst, tag) in anysource
        sent, received = sends.get(channel, []), recvs.get(channel, [])
        bad = None if lenient else _first_bad_pair(channel, sent, received)
        if bad is None and len(received) > len(sent) and src in done:
            k = len(sent)
            bad = Mismatch(src, dst, tag, k, "the receive was never sent", None, received[k])
        if bad is None and len(sent) > len(received):
            if lenient:
                surplus.setdefault((dst, tag), []).extend(sent[len(received) :])
                continue
            if dst not in done:
                continue
            k = len(received)
            bad = Mismatch(src, dst, tag, k, "the send was never received", sent[k], None)
        if bad is not None:
            found.append(bad)
    complete = len(done) == world_size
    for (dst, tag), posted in anysource.items():
        extra = surplus.get((dst, tag), [])
        if len(extra) > len(posted) and dst in done:
            m = extra[len(posted)]
            k = sends[(m.rank, dst, tag)].index(m)
            problem = "the send was never received (not even by a receive from any source)"
            found.append(Mismatch(m.rank, dst, tag, k, problem, m, None))
        elif len(extra) < len(posted) and complete:
            m = posted[len(extra)]
            problem = "no rank sent a message this receive from any source could take"
            found.append(Mismatch(-1, dst, tag, len(extra), problem, None, m))
    return found


def _first_bad_pair(
    channel: Channel, sent: list[Message], received: list[Message]
) -> Mismatch | None:
    for k, (s, r) in enumerate(zip(sent, received)):
        problem = _pair_problem(s.op, r.op)
        if problem is not None:
            return Mismatch(*channel, k, problem, s, r)
    return None


def describe(mismatch: Mismatch, absent: Callable[[int], str]) -> tuple[str, str, str]:
    """(what, side of the sender, side of the receiver) for a divergence message.

    ``absent(rank)`` words a side that made no matching call (``it returned after step 5``).
    """
    m = mismatch
    src = "any rank" if m.src < 0 else f"rank {m.src}"
    tag = f" (tag {m.tag})" if m.tag else ""
    what = (
        f"their point-to-point messages {src} -> rank {m.dst}{tag} at index {m.index} of that "
        f"pair's sequence: {m.problem}"
    )

    def side(msg: Message | None, rank: int, verb: str) -> str:
        if msg is not None:
            at = f"{format_site(msg.site)} (step {msg.step})" if msg.site else f"step {msg.step}"
            return f"rank {msg.rank} called {msg.op.describe()} at {at}"
        return f"rank {rank} made no matching {verb} ({absent(rank)})"

    if m.src < 0:
        send_side = "no other rank sent it a message with that tag"
    else:
        send_side = side(m.send, m.src, "send")
    return what, send_side, side(m.recv, m.dst, "receive")
