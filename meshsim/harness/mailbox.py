"""Point-to-point for the threaded tier: torch's threaded backend has collectives only.

``install`` gives torch's ``ProcessLocalGroup`` ``send`` / ``recv`` / ``recv_anysource``
methods backed by one in-process mailbox, so ``send``, ``isend``, ``recv``, ``irecv`` (also
from any source), ``*_object_list`` and ``batch_isend_irecv`` run on the threaded tier.

Semantics: a send is buffered (it copies the tensor and completes at once, like gloo for small
messages); a receive completes when a matching message is there, so ``irecv`` posted before
the peer's ``isend`` (a ring exchange) does not deadlock. Messages are matched per (group,
source, destination, tag) in order; a receive from any source takes the oldest message to it
with that tag. A send that nobody receives just stays in the mailbox and a receive whose
buffer does not fit the message is left untouched: the post-run point-to-point check
(``meshsim.harness.p2p``) reports both. A receive that is never satisfied waits until the run's
deadline, when the harness aborts the world and names the call in the ``RankTimeout``.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from meshsim import torch_private
from meshsim.harness import rng

#: How often a blocked ``wait`` looks at the threaded world's abort flag.
POLL_S = 0.05

_lock = threading.Lock()
_queued: dict[tuple, list[tuple[int, Any]]] = {}  # (group, dst, tag) -> [(src, tensor)]
_pending: dict[tuple, list[_Receive]] = {}  # (group, dst, tag) -> receives in posting order
_work_type: Any = None


@dataclass(eq=False)
class _Receive:
    """A posted receive: its buffer, wanted source (``None``: any) and completion."""

    tensor: Any
    src: int | None
    done: threading.Event = field(default_factory=threading.Event)
    source: int = -1

    def fill(self, src: int, data: Any) -> None:
        """Copy ``data`` in when it fits (same dtype and size); mark the receive complete.
        The copy bypasses autograd, as a backend's write does: a pipeline stage receives its
        input into a leaf buffer that requires grad."""
        if data.dtype == self.tensor.dtype and data.numel() == self.tensor.numel():
            self.tensor.detach().copy_(data.reshape(self.tensor.shape))
        self.source = src
        self.done.set()


def reset() -> None:
    """Forget every message and receive (between runs: nothing leaks into the next one)."""
    with _lock:
        _queued.clear()
        _pending.clear()


def install(plg: Any) -> None:
    """Give ``plg`` (torch's ``ProcessLocalGroup``) point-to-point methods, once."""
    global _work_type
    if getattr(plg, "__meshsim_p2p__", False):
        return
    _work_type = _make_work_type(plg)
    plg.send = _send
    plg.recv = _recv
    plg.recv_anysource = _recv_anysource
    plg.__meshsim_p2p__ = True
    torch_private.make_threaded_group_its_own_backend(plg)


def _make_work_type(plg: Any) -> type:
    import torch.distributed as dist

    class P2PWork(dist.Work):
        """Completes with its receive; a blocked ``wait`` leaves when the world is aborted."""

        def __init__(self, receive: _Receive | None) -> None:
            super().__init__()
            self.receive = receive

        def wait(self, timeout: Any = None) -> bool:
            del timeout  # the harness's deadline applies
            with rng.stepped_out():
                while self.receive is not None and not self.receive.done.wait(POLL_S):
                    if torch_private.threaded_world_aborted():
                        sys.exit("Test termination event occurs.")  # as torch's collectives
            return True

        def is_completed(self) -> bool:
            return self.receive is None or self.receive.done.is_set()

        def is_success(self) -> bool:
            return self.is_completed()

        def _source_rank(self) -> int:
            return self.receive.source if self.receive is not None else -1

    return P2PWork


def _send(pg: Any, tensors: list, dst: int, tag: int) -> Any:
    key, src = (pg.pg_name, dst, tag), torch_private.threaded_group_rank(pg)
    data = tensors[0].detach().clone()
    with _lock:
        waiting = _pending.get(key, [])
        match = next((r for r in waiting if r.src in (None, src)), None)
        if match is None:
            _queued.setdefault(key, []).append((src, data))
        else:
            waiting.remove(match)
    if match is not None:
        match.fill(src, data)
    return _work_type(None)


def _post(pg: Any, tensor: Any, src: int | None, tag: int) -> Any:
    key = (pg.pg_name, torch_private.threaded_group_rank(pg), tag)
    receive = _Receive(tensor, src)
    with _lock:
        queued = _queued.get(key, [])
        message = next((m for m in queued if src in (None, m[0])), None)
        if message is None:
            _pending.setdefault(key, []).append(receive)
        else:
            queued.remove(message)
    if message is not None:
        receive.fill(*message)
    return _work_type(receive)


def _recv(pg: Any, tensors: list, src: int, tag: int) -> Any:
    return _post(pg, tensors[0], src, tag)


def _recv_anysource(pg: Any, tensors: list, tag: int) -> Any:
    return _post(pg, tensors[0], None, tag)
