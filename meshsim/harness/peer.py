"""One point-to-point message as the rank that sends or receives it describes it.

The recorder reads these off each ``send``/``recv`` call as it happens, and
:mod:`meshsim.harness.p2p` matches them across ranks after the run; both need the record, so
it sits below both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshsim import torch_private


@dataclass(frozen=True)
class PeerOp:
    """One message of a point-to-point call, seen from the rank that made the call.

    ``peer`` is the other side's global rank (``None``: a receive from any source);
    ``shape``/``dtype`` describe the tensor (``None`` for object lists, whose size is theirs).
    """

    op: str
    sends: bool
    peer: int | None
    tag: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def family(self) -> str:
        """``object`` for ``*_object_list`` (they pair only with each other), else ``tensor``."""
        return "object" if self.op.endswith("_object_list") else "tensor"

    def describe(self) -> str:
        where = ("to" if self.sends else "from") + (
            " any rank" if self.peer is None else f" rank {self.peer}"
        )
        tag = f" tag {self.tag}" if self.tag else ""
        size = f" with shape {self.shape} {self.dtype}" if self.shape is not None else ""
        return f"{self.op} {where}{tag}{size}"


def peer_ops(op: str, bound: Mapping[str, Any]) -> tuple[PeerOp, ...]:
    """The messages of one recorded call, from its bound arguments (``recorder._describe``)."""
    if op == "batch_isend_irecv":
        return tuple(_batch_op(p) for p in bound.get("p2p_op_list") or [])
    sends = op in ("send", "isend", "send_object_list")
    group = bound.get("group")
    peer = bound.get("dst" if sends else "src")
    local = bound.get("group_dst" if sends else "group_src")
    if peer is None and local is not None:
        peer = _global_rank(group, local)
    tensor = None if op.endswith("_object_list") else bound.get("tensor")
    return (_op(op, sends, peer, bound.get("tag", 0), tensor),)


def _batch_op(p2p: Any) -> PeerOp:
    name = getattr(p2p.op, "__name__", str(p2p.op))
    peer = getattr(p2p, "peer", None)
    if peer is None and getattr(p2p, "group_peer", None) is not None:
        peer = _global_rank(p2p.group, p2p.group_peer)
    return _op(name, name == "isend", peer, p2p.tag, p2p.tensor)


def _op(op: str, sends: bool, peer: Any, tag: Any, tensor: Any) -> PeerOp:
    shape = getattr(tensor, "shape", None)
    dtype = getattr(tensor, "dtype", None)
    return PeerOp(
        op,
        sends,
        None if peer is None else int(peer),
        int(tag or 0),
        None if shape is None else tuple(shape),
        None if dtype is None else str(dtype).replace("torch.", ""),
    )


def _global_rank(group: Any, local: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group or torch_private.default_group(), int(local))
