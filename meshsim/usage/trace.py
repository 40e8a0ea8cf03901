"""``GradientTrace``: on each rank, which collectives reduced which parameter's gradient.

Around a step's backward and gradient reduction, the trace attaches to the harness recorder
(``meshsim.harness.recorder``) as a sink in front of the rank's own: every collective is still
recorded as before, and the trace also keeps the *storage* of each reduction's tensors (a weak
reference to the storage and the byte range used). After the step, ``reductions(model)``
matches those against each parameter's gradient, and says where each match came from:

* **observed, by storage**: an explicit ``dist.all_reduce`` / ``reduce_scatter*`` /
  ``all_reduce_coalesced`` / ``reduce`` on ``param.grad`` (or ``param.main_grad``, Megatron's
  grad buffer), on a view of it, or on a flat buffer ``param.grad`` is a view of (Megatron's
  bucketed grad buffer, FSDP2's reduce-scatter output). A buffer the gradient was *copied*
  into or out of is not matched: a copy leaves no trace in the storage.
* **FSDP2** (``fully_shard``): its reduce-scatter over the shard group and, under HSDP, its
  all-reduce over the replicate group are Python calls, so they are recorded; the gradient is
  a view of the reduce-scatter output and matches by storage. Where it does not (a gradient
  accumulated into one an untraced micro-batch left, a different storage), the module's FSDP
  state names the groups and a recorded call of the same kind over the same group confirms
  it; with no such call (``set_requires_gradient_sync(False)``) nothing is claimed.
* **DDP** (``DistributedDataParallel``): its reducer runs in C++ and calls the process group
  directly, so nothing of it is recorded. The parameters it covers (minus those it ignores)
  and its ``process_group`` are *read* from the wrapper, and only one thing is observed: a
  last forward run under ``no_sync()`` (the reducer was not armed) counts as no reduction.
  A DDP comm hook that reduces elsewhere is not seen.
* **DTensor**: a ``Partial`` gradient is reduced by redistribution, a functional
  ``all_reduce`` over a mesh dim. Redistributed inside the trace (``p.grad =
  p.grad.redistribute(p.device_mesh, p.placements)``), the reduced tensor becomes the
  gradient and matches by storage. On torch 2.13 a plain DTensor parameter's gradient is
  still ``Partial`` after backward (nothing reduced it), and under FSDP2 the resolved gradient
  is copied into the reduce-scatter buffer (the copy): neither is attributed. A functional
  reduction over a dim the parameter is ``Replicate`` on is DTensor keeping its own
  placement, which the check accepts without it being a need.

Pass the outermost model (the DDP wrapper, not its ``.module``) so the wrappers are found.
Trace one step: a gradient reduced in two steps reads as reduced twice.

``strays(expected)`` lists the collectives of the trace over a group the reference defines
under no kind (nor the world), with their call sites. Calls through a function bound before
the recorder was installed (``from torch.distributed import all_reduce`` at import time of a
module loaded earlier) are not recorded, as for every recorder use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from meshsim.errors import UsageError
from meshsim.harness import recorder
from meshsim.harness.sites import format_site
from meshsim.model.expected import Expected
from meshsim.usage import wrappers
from meshsim.usage.group_names import find_strays
from meshsim.usage.param_roles import Marks
from meshsim.usage.trace_records import FUNCTIONAL, Collective, ParamTrace, RankTrace

#: Collectives that reduce their tensors (c10d names and functional ones, suffix stripped).
REDUCING = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter_single_autograd",
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor_autograd",
        "reduce_scatter_tensor_coalesced",
    }
)
#: How a reduction read from a DDP wrapper is named (its reducer is not recorded).
DDP_OP = "all_reduce by DistributedDataParallel (read from the wrapper)"


@dataclass
class _Record:
    call: recorder.Call
    spans: tuple[tuple[int, int, int], ...]  # (storage id, first byte, end byte)
    refs: tuple[Any, ...]  # weak refs: keep each storage id unique while the trace lives


class GradientTrace:
    """Record which collectives reduced which gradient on this rank (a context manager).

    Example:
        ```python
        with GradientTrace() as trace:
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
        return trace.result(model)  # a RankTrace, checked in the parent
        ```
    """

    def __init__(self) -> None:
        self._records: list[_Record] = []
        self._restore: Any = None
        self._lock = threading.Lock()

    # -- recording ------------------------------------------------------------------------
    def __enter__(self) -> GradientTrace:
        if self._restore is not None:
            raise UsageError("a GradientTrace is entered once: make a new one for each step")
        recorder.install()
        own = getattr(recorder._tls, "sink", None)
        if own is not None:  # an in-process rank (threaded, fake): its thread's sink
            recorder.set_sink(_Tap(own, self))
            self._restore = lambda: recorder.set_sink(own)
        else:  # a process rank (gloo, nccl) or no harness: every thread of the process
            previous = recorder._process_sink
            recorder.set_sink(_Tap(previous, self), process_wide=True)
            self._restore = lambda: recorder.set_sink(previous, process_wide=True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = lambda: None
            recorder.uninstall()

    def _observe(self, call: recorder.Call, arguments: dict[str, Any], result: Any) -> None:
        spans: list[tuple[int, int, int]] = []
        refs: list[Any] = []
        if call.op.removesuffix(FUNCTIONAL) in REDUCING:
            for tensor in _tensors([*arguments.values(), result]):
                found = _span(tensor)
                if found is not None:
                    spans.append(found[0])
                    refs.append(found[1])
        with self._lock:
            self._records.append(_Record(call, tuple(spans), tuple(refs)))

    # -- reading --------------------------------------------------------------------------
    def collectives(self) -> tuple[Collective, ...]:
        """Every collective of the trace on this rank, in order (the world spelled out)."""
        world = _world_size()
        return tuple(_collective(r.call, world) for r in self._records)

    def reductions(self, model: Any) -> dict[str, tuple[Collective, ...]]:
        """Parameter name -> the reductions of its gradient on this rank, in order.

        Parameters without a gradient are left out.
        """
        return {p.name: p.reductions for p in self._param_traces(model)}

    def result(self, model: Any) -> RankTrace:
        """This rank's findings as plain values, to return from a ``meshsim.run`` body."""
        import torch.distributed as dist

        return RankTrace(
            dist.get_rank(), _world_size(), tuple(self._param_traces(model)), self.collectives()
        )

    def strays(self, expected: Expected) -> tuple[Collective, ...]:
        """Collectives of the trace over a group the reference defines under no kind."""
        return find_strays(self.collectives(), expected)

    def _param_traces(self, model: Any) -> list[ParamTrace]:
        if not hasattr(model, "named_parameters"):
            raise UsageError(
                f"reductions takes the model (a torch.nn.Module or wrapper), got "
                f"{type(model).__name__}"
            )
        world = _world_size()
        ddp = wrappers.ddp_covers(model)
        fsdp = wrappers.fsdp_covers(model)
        traces = []
        for name, param in model.named_parameters():
            grads = [g for g in (param.grad, getattr(param, "main_grad", None)) if g is not None]
            if not grads:
                continue
            found = self._matching(grads, world)
            note = None
            if id(param) in fsdp:
                found += self._confirmed(fsdp[id(param)], found, world)
            if id(param) in ddp:
                cover = ddp[id(param)]
                if cover.synced:
                    group = cover.group or tuple(range(world))
                    found.append(Collective(DDP_OP, group, None))
                else:
                    note = "DistributedDataParallel's last forward ran under no_sync()"
            traces.append(
                ParamTrace(name, Marks.of(param), tuple(found), _replicated_over(param), note)
            )
        return traces

    def _matching(self, grads: list[Any], world: int) -> list[Collective]:
        targets = [s for s in (_span(g) for g in grads) if s is not None]
        found = []
        for record in self._records:
            if any(_overlap(span, target[0]) for span in record.spans for target in targets):
                found.append(_collective(record.call, world))
        return found

    def _confirmed(
        self, cover: wrappers.FsdpCover, found: list[Collective], world: int
    ) -> list[Collective]:
        """FSDP2's reductions of a parameter its storage did not match, each confirmed by a
        recorded call of that kind over that group (nothing claimed without one)."""
        extra = []
        for group, ops in ((cover.shard, "reduce_scatter"), (cover.replicate, "all_reduce")):
            if group is None or any(set(c.group) == set(group) for c in found):
                continue
            for record in self._records:
                call = _collective(record.call, world)
                if call.op.startswith(ops) and set(call.group) == set(group):
                    extra.append(call)
                    break
        return extra


class _Tap:
    """A sink in front of the rank's own: forwards every call to it and tells the trace.

    Anything else asked of the sink (the harness's ``where``, ``call_behind``, the counters
    other checks keep on it) goes to the rank's own sink, so the trace changes nothing else.
    """

    __slots__ = ("_extra", "_previous", "_trace")

    def __init__(self, previous: Any, trace: GradientTrace) -> None:
        object.__setattr__(self, "_previous", previous)
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "_extra", {})

    def enter(self, call: recorder.Call) -> None:
        if self._previous is not None:
            self._previous.enter(call)

    def exit(self, call: recorder.Call, error: BaseException | None = None) -> None:
        if self._previous is not None:
            self._previous.exit(call, error)

    def observe(self, call: recorder.Call, arguments: dict[str, Any], result: Any) -> None:
        if call.kind == "collective":
            self._trace._observe(call, arguments, result)
        forward = getattr(self._previous, "observe", None)
        if forward is not None:
            forward(call, arguments, result)

    def __getattr__(self, name: str) -> Any:
        if self._previous is not None:
            return getattr(self._previous, name)
        try:
            return self._extra[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if self._previous is not None:
            setattr(self._previous, name, value)
        else:
            self._extra[name] = value


# ---------------------------------------------------------------------------- tensors


def _tensors(values: list[Any]) -> list[Any]:
    """Every tensor among ``values`` and the lists in them (reduce_scatter's input list)."""
    import torch

    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += _tensors(list(value))
    return out


def _local(tensor: Any) -> Any:
    """The plain tensor holding ``tensor``'s data: a DTensor's local shard, the tensor a
    functional collective's ``AsyncCollectiveTensor`` wraps."""
    from torch.distributed.tensor import DTensor

    for _ in range(4):  # DTensor of an AsyncCollectiveTensor, at most a few levels
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        elif type(tensor).__name__ == "AsyncCollectiveTensor" and hasattr(tensor, "elem"):
            tensor = tensor.elem
        else:
            break
    return tensor


def _span(tensor: Any) -> tuple[tuple[int, int, int], Any] | None:
    """(storage id, first byte, end byte) of the memory ``tensor`` reaches, and a weak
    reference that keeps that id from being reused while it lives; ``None`` if it has none."""
    from torch.multiprocessing import reductions

    weak_ref: Any = reductions.StorageWeakRef  # untyped in torch
    try:
        tensor = _local(tensor)
        if tensor.numel() == 0:
            return None
        ref = weak_ref(tensor.untyped_storage())
        size = tensor.element_size()
        reach = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
        start = tensor.storage_offset() * size
        return (ref.cdata, start, start + reach * size), ref
    except Exception:  # a tensor without storage (a subclass, a fake tensor): not matched
        return None


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _replicated_over(param: Any) -> tuple[tuple[int, ...], ...]:
    """The groups of the mesh dims ``param`` is a ``Replicate`` DTensor on."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(
        tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
        for dim, placement in enumerate(param.placements)
        if placement.is_replicate()
    )


def _collective(call: recorder.Call, world: int) -> Collective:
    group = call.group if call.group is not None else tuple(range(world))
    return Collective(call.op, group, None if call.site is None else format_site(call.site))


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
