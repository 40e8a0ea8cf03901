"""Record each rank's process-group creations and collectives by wrapping torch's entry points.

Used by every tier to compare ranks' call sequences and by every timeout report
(to say which collective each rank was blocked in). The wrappers are installed process-wide
(``install``/``uninstall``, reference counted) and cost one thread-local lookup when no sink
is active. Only the outermost call is recorded: ``all_gather_object`` is one event, not the
``all_gather`` it issues inside.

Limitation: a function bound *before* ``install`` by user code (``from torch.distributed
import all_reduce`` at import time of a module loaded earlier) keeps the original and is not
recorded. Modules under ``torch.distributed`` are re-bound at install time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshsim import torch_private
from meshsim.harness.outcome import format_group
from meshsim.harness.peer import peer_ops
from meshsim.harness.sites import Site, call_site, format_site

# c10d entry points that are collective over their group.
COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_gather",
    "all_gather_single",  # the name newer torch (2.13) uses; FSDP2 calls it
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",  # the name newer torch (2.13) uses; FSDP2 calls it
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "monitored_barrier",
)
# Point-to-point: each call's messages (``Call.ops``) are matched send-to-recv after the run
# (``meshsim.harness.p2p``), not compared like collectives.
P2P = (
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
)
# Functional collectives (DTensor, FSDP2, compiled code) live in their own module.
FUNCOL = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_single",  # newer torch's (2.13) names; DTensor calls them
    "all_gather_single_autograd",
    "all_gather_single_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "reduce_scatter_single_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "permute_tensor",
)
# Collectives whose tensor argument must have the same shape and dtype on every rank: the
# argument named here is compared (outputs of all_gather / inputs of reduce_scatter may differ
# only where torch allows it, so the per-rank side is used).
SHAPED = {
    "broadcast": "tensor",
    "all_reduce": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_single": "input_tensor",
    "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_single": "output",
    "reduce_scatter_tensor": "output",
    "_reduce_scatter_base": "output",
}
# Group creation: ``new_group``, ``new_subgroups*`` and DeviceMesh all reach
# ``_new_group_with_tag``; ``split_group`` is separate (and bound by name in device_mesh).
CREATIONS = {"_new_group_with_tag": "new_group", "split_group": "split_group"}


@dataclass(frozen=True)
class Call:
    """One recorded call. ``group`` is the group's global ranks, ``None`` for the world.

    ``kind``: ``collective``, ``p2p`` or ``create``. ``local`` marks a creation that only
    synchronises the new group's members (``use_local_synchronization=True``). ``meta`` is the
    tensor shape and dtype for collectives whose inputs torch requires to match on every rank
    (``None`` where sizes may legitimately differ: uneven all_to_all, ``*_object``). ``ops``:
    for a point-to-point call, its messages (one, or one per op of ``batch_isend_irecv``).
    ``async_op``: the call returns a work or tensor to wait on later, so the rank is not
    blocked inside it (not compared between ranks). ``site``: the (file, line) of the user's
    code that made the call (``meshsim.harness.sites``), what reports name instead of a step
    number; not compared between ranks (ranks may reach one collective from different lines).
    """

    kind: str
    op: str
    group: tuple[int, ...] | None
    detail: str | None = None
    local: bool = False
    meta: str | None = None
    ops: tuple[Any, ...] = ()
    async_op: bool = False  # returns before its peers arrive (async_op=True, functional)
    site: Site | None = field(default=None, compare=False)

    def describe(self, world_size: int | None = None) -> str:
        where = format_group(self.group, world_size)
        if self.kind == "create":
            text = f"{self.op} for {where}"
            return text + (f" ({self.detail})" if self.detail else "")
        if self.kind == "p2p":
            return f"{self.op} {self.detail or ''} on {where}".replace("  ", " ")
        return f"{self.op} on {where}"

    def signature(self, world_size: int | None = None) -> str:
        """``describe`` plus the shape/dtype compared between ranks (divergence messages)."""
        return self.describe(world_size) + (f" with {self.meta}" if self.meta else "")

    def where(self) -> str | None:
        """``tests/test_x.py:12``: the user's line that made the call, when it is known."""
        return None if self.site is None else format_site(self.site)


class Sink(Protocol):
    """Receives the calls of one rank.

    A sink may also define ``observe(call, arguments, result)``: it is then handed each
    finished call's bound arguments and return value (the tensors a call reduced, for
    ``meshsim.usage.trace``); an error it raises is swallowed, as describing's is.
    """

    def enter(self, call: Call) -> None: ...

    def exit(self, call: Call, error: BaseException | None = None) -> None: ...


_tls = threading.local()
_process_sink: Sink | None = None
_install_lock = threading.Lock()
_install_count = 0
_patched: list[tuple[Any, str, Any]] = []


def set_sink(sink: Sink | None, *, process_wide: bool = False) -> None:
    """Route this thread's (or, as a fallback, every thread's) calls to ``sink``."""
    global _process_sink
    if process_wide:
        _process_sink = sink
    else:
        _tls.sink = sink


def _current_sink() -> Sink | None:
    return getattr(_tls, "sink", None) or _process_sink


# ---------------------------------------------------------------------------- describing


def group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of ``group`` in any form torch accepts; ``None`` means the world."""
    import torch.distributed.distributed_c10d as c10d

    if group is None:
        return None
    if isinstance(group, str):
        group = torch_private.resolve_group(group)
    elif isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
        group = group[0].get_group(group[1])
    elif hasattr(group, "get_group") and hasattr(group, "mesh"):
        group = group.get_group()
    elif isinstance(group, list):
        flat = [r for sub in group for r in (sub if isinstance(sub, list) else [sub])]
        return tuple(int(r) for r in flat)
    if group is c10d.GroupMember.WORLD:
        return None
    return tuple(c10d.get_process_group_ranks(group))


class _Binder:
    """``inspect.Signature.bind_partial(...).arguments`` for the calls torch's entry points
    get, by position: ``bind_partial`` was a sixth of a megatron layout built on fake ranks
    (185 ``new_group`` calls a rank). Anything unusual (``*args``, a keyword naming a
    positional-only or already given parameter) goes to ``bind_partial``."""

    def __init__(self, sig: inspect.Signature) -> None:
        kinds = inspect.Parameter
        params = sig.parameters.values()
        self.sig = sig
        self.names = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        self.keywords = frozenset(
            p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        )
        self.plain = not any(p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) for p in params)

    def __call__(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        given = self.names[: len(args)]
        if (
            self.plain
            and len(args) <= len(self.names)
            and self.keywords.issuperset(kwargs)
            and kwargs.keys().isdisjoint(given)
        ):
            bound = dict(zip(given, args))
            bound.update(kwargs)
            return bound
        try:
            return dict(self.sig.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return {}


def _describe(
    kind: str, op: str, binder: _Binder, args: tuple, kwargs: dict, site: Site | None
) -> Call:
    bound = binder(args, kwargs)
    try:
        if kind == "create":
            return _describe_creation(op, bound, site)
        group = group_ranks(bound.get("group"))
        detail = None
        messages: tuple[Any, ...] = ()
        if kind == "p2p":
            messages = peer_ops(op, bound)
            peer = next(
                (
                    bound[k]
                    for k in ("dst", "src", "group_dst", "group_src")
                    if bound.get(k) is not None
                ),
                None,
            )
            if op == "batch_isend_irecv":
                ops = bound.get("p2p_op_list") or []
                group = group_ranks(getattr(ops[0], "group", None)) if ops else None
                detail = f"of {len(ops)} ops"
            elif peer is not None:
                detail = "to" if op in ("send", "isend", "send_object_list") else "from"
                detail += f" rank {peer}"
        meta = _tensor_meta(bound.get(SHAPED[op])) if op in SHAPED else None
        async_op = op.endswith("(functional)") or bool(bound.get("async_op", False))
        return Call(kind, op, group, detail, meta=meta, ops=messages, async_op=async_op, site=site)
    except Exception as exc:  # describing must never break the call itself
        return Call(kind, op, None, f"group unknown: {type(exc).__name__}", site=site)


def _tensor_meta(tensor: Any) -> str | None:
    shape = getattr(tensor, "shape", None)
    if shape is None:
        return None
    return f"shape {tuple(shape)} {str(getattr(tensor, 'dtype', '')).replace('torch.', '')}"


def _describe_creation(op: str, bound: dict, site: Site | None = None) -> Call:
    desc = bound.get("group_desc")
    if op == "split_group":
        parent = group_ranks(bound.get("parent_pg"))
        split = bound.get("split_ranks") or []
        detail = f"into {[tuple(s) for s in split][:4]}{'...' if len(split) > 4 else ''}"
        if desc:
            detail += f", desc={desc!r}"
        return Call("create", op, parent, detail, site=site)
    ranks = bound.get("ranks")
    group = None if ranks is None else tuple(sorted(int(r) for r in ranks))
    local = bool(bound.get("use_local_synchronization", False))
    return Call("create", op, group, f"desc={desc!r}" if desc else None, local, site=site)


# ---------------------------------------------------------------------------- wrapping


def _wrap(kind: str, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    binder = _Binder(inspect.signature(original))

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sink = _current_sink()
        if sink is None or getattr(_tls, "depth", False):
            return original(*args, **kwargs)
        call = _describe(kind, op, binder, args, kwargs, call_site(sys._getframe(1)))
        _tls.depth = 1
        try:
            sink.enter(call)
            result = original(*args, **kwargs)
        except BaseException as exc:
            _tls.depth = 0
            sink.exit(call, exc)
            raise
        _tls.depth = 0
        sink.exit(call)
        observe = getattr(sink, "observe", None)
        if observe is not None:
            with contextlib.suppress(Exception):  # observing must never break the call
                observe(call, binder(args, kwargs), result)
        return result

    wrapper.__meshsim_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _targets() -> list[tuple[Any, str, str, str]]:
    """(module, attribute, kind, op) for every entry point to wrap."""
    funcol = torch_private.functional_collectives()
    import torch.distributed.distributed_c10d as c10d

    out: list[tuple[Any, str, str, str]] = []
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            out.append((c10d, name, "collective", name))
    for name in P2P:
        if hasattr(c10d, name):
            out.append((c10d, name, "p2p", name))
    for name, op in CREATIONS.items():
        if hasattr(c10d, name):
            out.append((c10d, name, "create", op))
    for name in FUNCOL:
        if hasattr(funcol, name):
            out.append((funcol, name, "collective", f"{name} (functional)"))
    return out


def install() -> None:
    """Wrap torch.distributed's entry points (idempotent, reference counted)."""
    global _install_count
    with _install_lock:
        _install_count += 1
        if _install_count > 1:
            return
        replacements: dict[int, Any] = {}
        for module, attr, kind, op in _targets():
            original = getattr(module, attr)
            wrapper = _wrap(kind, op, original)
            replacements[id(original)] = (original, wrapper)
            _patched.append((module, attr, original))
            setattr(module, attr, wrapper)
        # Re-bind aliases (``torch.distributed.all_reduce``, device_mesh's ``split_group``).
        for name, module in list(sys.modules.items()):
            if not name.startswith("torch.distributed") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                hit = replacements.get(id(value))
                if hit is not None and hit[0] is value:
                    _patched.append((module, attr, value))
                    setattr(module, attr, hit[1])


def uninstall() -> None:
    """Undo ``install`` once every user of the wrappers is done."""
    global _install_count
    with _install_lock:
        _install_count = max(0, _install_count - 1)
        if _install_count:
            return
        while _patched:
            module, attr, original = _patched.pop()
            setattr(module, attr, original)


# ---------------------------------------------------------------------------- sinks


class TrackingSink:
    """Keeps the call in progress and the last finished one (for timeout reports)."""

    def __init__(self) -> None:
        self.current: Call | None = None
        self.last: Call | None = None
        self.raised_in: Call | None = None
        #: ``id`` of the exception ``raised_in`` raised (no reference kept: its traceback
        #: holds frames), so a caller holding an exception can ask whether it came out of it.
        self.raised_id: int | None = None
        self.count = 0

    def enter(self, call: Call) -> None:
        self.current = call
        self.count += 1

    def created(self, calls: Sequence[Call]) -> None:
        """``calls``, world-synchronised creations, were each entered and left without error,
        in order (the fake tier's non-member fast path records a dim's skipped rows so)."""
        for call in calls:
            self.enter(call)
            self.exit(call)

    def exit(self, call: Call, error: BaseException | None = None) -> None:
        # ``raised_in`` before ``current``: a reader that finds no call in progress then
        # finds the one just raised out of (``snapshot`` reads in the other order).
        self.raised_id = id(error) if error is not None else None
        self.raised_in = call if error is not None else None
        self.last = call
        self.current = None

    def where(self, world_size: int | None = None) -> str | None:
        """``all_reduce on group (0,1) (call #3)`` while blocked, else ``None``."""
        return _numbered(self.current, self.count, world_size)

    def raised_where(self, world_size: int | None = None) -> str | None:
        """The call the last exception came out of, if it came out of one."""
        return _numbered(self.raised_in, self.count, world_size)

    def call_behind(self, error: BaseException) -> Call | None:
        """The recorded call ``error`` (or an exception it was raised from) came out of, or
        None: a framework that catches torch's error and raises its own is still traced."""
        seen: set[int] = set()
        link: BaseException | None = error
        while link is not None and id(link) not in seen:
            if self.raised_in is not None and id(link) == self.raised_id:
                return self.raised_in
            seen.add(id(link))
            link = link.__cause__ or link.__context__
        return None

    def snapshot(
        self, world_size: int | None = None, woken: bool = False
    ) -> tuple[Call | None, str | None]:
        """(the call in progress, ``where``) read once, so the two agree.

        ``woken``: the world was aborted, so a rank found outside any call may have just been
        woken out of one; ``where`` then names the call it raised out of (the call stays None:
        it is no longer in it).
        """
        call, count = self.current, self.count
        where_call = call
        if call is None and woken:
            where_call = self.raised_in
        return call, _numbered(where_call, count, world_size)


def _numbered(call: Call | None, count: int, world_size: int | None) -> str | None:
    """``all_reduce on group (0,1) (call #3)``; ``None`` without a call."""
    return None if call is None else f"{call.describe(world_size)} (call #{count})"


class ListSink(TrackingSink):
    """Also keeps every call in order (the fake tier's per-rank sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def enter(self, call: Call) -> None:
        super().enter(call)
        self.calls.append(call)


class StreamSink(TrackingSink):
    """Appends every call to a file as it is entered and left, for a parent process to read.

    A rank process can hang, crash or be killed, so what it did must already be outside it:
    each call is written *before* it is issued (and a marker after it returns), so the parent
    sees the call a rank is blocked in and every call before it, whatever ends the run. One
    ``write`` per record on an ``O_APPEND`` descriptor: a killed process leaves whole records
    (``StreamReader`` ignores a torn last one). Each record names its thread, and whether the
    body had started threads of its own by then (``extra_threads``, counted against
    ``baseline_threads``): the parent then cannot tell which thread a rank waits in.
    ``broken``: a write failed (disk full), so the recording cannot be trusted.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.baseline_threads = threading.active_count()
        self.broken = False

    def _write(self, record: tuple) -> None:
        import os
        import pickle
        import struct

        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            os.write(self._fd, struct.pack("<I", len(data)) + data)
        except OSError:
            self.broken = True

    def enter(self, call: Call) -> None:
        super().enter(call)
        extra = threading.active_count() > self.baseline_threads
        self._write(("enter", call, threading.get_ident(), extra))

    def exit(self, call: Call, error: BaseException | None = None) -> None:
        super().exit(call, error)
        self._write(("exit", error is not None, threading.get_ident(), False))


class StreamReader:
    """The parent's view of one rank's ``StreamSink`` file, read incrementally.

    ``calls``: every call the rank entered, in order; ``current``: the call it entered last
    and has not left (``None`` between calls); ``blocked_in``: the same, but only while the
    rank is known to run one thread (else ``None``: it may be moving in another);
    ``raised_in``: the call the last exception came out of; ``corrupt``: the file could not
    be parsed.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[Call] = []
        self.raised_in: Call | None = None
        self.corrupt = False
        self._open: dict[int, Call] = {}  # thread -> the call it is inside
        self._last: int | None = None  # the thread that entered a call last
        self._threads: set[int] = set()
        self._extra = False
        self._offset = 0
        self._buffer = b""

    @property
    def current(self) -> Call | None:
        if self._last is not None and self._last in self._open:
            return self._open[self._last]
        return next(reversed(self._open.values()), None)

    @property
    def blocked_in(self) -> Call | None:
        if self.many_threads:
            return None
        return self.current

    @property
    def many_threads(self) -> bool:
        """The body ran threads of its own by some call: where it waits cannot be told."""
        return self._extra or len(self._threads) > 1

    def poll(self) -> bool:
        """Read what was appended since the last poll; True when there was anything."""
        import pickle
        import struct

        if self.corrupt:
            return False
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return False
        if not data:
            return False
        self._offset += len(data)
        buf = self._buffer + data
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = struct.unpack_from("<I", buf, pos)
            if len(buf) - pos - 4 < size:
                break
            try:
                kind, value, thread, extra = pickle.loads(buf[pos + 4 : pos + 4 + size])
            except Exception:
                self.corrupt = True
                return True
            pos += 4 + size
            self._threads.add(thread)
            self._extra = self._extra or extra
            if kind == "enter":
                self.calls.append(value)
                self._open[thread] = value
                self._last = thread
            else:
                done = self._open.pop(thread, None)
                self.raised_in = done if value else None
        self._buffer = buf[pos:]
        return True

    def where(self, world_size: int | None = None) -> str | None:
        """``all_reduce on group (0,1) (call #3)`` while inside a call, else ``None``."""
        return _numbered(self.current, len(self.calls), world_size)

    def raised_where(self, world_size: int | None = None) -> str | None:
        """The call the rank's exception came out of, if it came out of one."""
        return _numbered(self.raised_in, len(self.calls), world_size)
