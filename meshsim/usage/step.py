"""The rank side of ``assert_matches_serial``: what the user's step receives and records.

One :class:`StepContext` per rank. The same step function runs on the N-rank world and on
the serial world of one rank; the context answers the questions that differ (which groups,
which slice of the global batch is mine) and captures, at each ``record``, full copies of the
logged values, the gradients and the parameters as plain numpy data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from meshsim.errors import UsageError
from meshsim.usage.tensors import Captured, RankTrail, Shard, Snapshot

#: Name parts wrappers insert (torch.compile, activation checkpointing, FSDP1), dropped so the
#: N-rank and the serial model name a parameter alike; DDP's ``module.`` only leads a name.
WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def plain_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


class StepContext:
    """What a step function receives on each rank, N-rank or serial.

    ``serial`` tells the twin apart; ``group(kind)`` / ``size(kind)`` / ``local_rank(kind)``
    answer for the reference's kinds and roles (``"tensor"``, ``"data_parallel"``, ``"tp"``,
    ...) and are a single-rank group, size 1 and local rank 0 in the serial twin;
    ``batch(step)`` is the global batch of a step, the same on both; ``record(model, **values)``
    captures the step (call it once per step, after the gradients are reduced and before the
    optimizer steps).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        serial: bool,
        expected: Any,
        batch: Callable[[int], Any] | None,
        steps: int,
        seed: int,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.serial = serial
        self.expected = expected
        self.steps = steps
        self.seed = seed
        self._batch = batch
        self._groups: dict[str, Any] = {}
        self._snapshots: list[Snapshot] = []
        self._trace: Any = None

    # -- tracing (N ranks only) -------------------------------------------------------------
    def start_trace(self) -> None:
        """Trace which collectives reduce each gradient until the next ``record``."""
        from meshsim.usage.trace import GradientTrace

        self._trace = GradientTrace().__enter__()

    def stop_trace(self) -> None:
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None

    def _reductions(
        self, model: Any, named: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], ...]] | None:
        """Each gradient's reducing groups since the last record (None: not traced)."""
        if self._trace is None:
            return None
        # The model itself where it is one, so the trace finds its DDP / FSDP2 wrappers.
        seen = model if hasattr(model, "named_parameters") else _Named(named)
        try:
            found = {plain_name(n): c for n, c in self._trace.reductions(seen).items()}
        except Exception:  # the trace only words a finding; it must never fail a step
            found = None
        self.stop_trace()
        self.start_trace()
        if found is None:
            return None
        return {n: tuple(tuple(c.group) for c in calls) for n, calls in found.items()}

    # -- layout -----------------------------------------------------------------------------
    def size(self, kind: str) -> int:
        """The size of this rank's group of ``kind`` (1 in the serial twin)."""
        group = self._members(kind)
        return len(group)

    def local_rank(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (0 in the serial twin)."""
        return self._members(kind).index(self.rank)

    def group(self, kind: str) -> Any:
        """This rank's process group of ``kind``; creates every group of the kind on first use,
        so all ranks must ask for the same kinds in the same order."""
        import torch.distributed as dist

        if self.serial:
            return dist.group.WORLD
        if kind not in self._groups:
            mine = None
            for members in self.expected.groups(kind):
                made = dist.new_group(list(members))
                if self.rank in members:
                    mine = made
            if mine is None:
                raise UsageError(f"rank {self.rank} is in no group of kind {kind!r}")
            self._groups[kind] = mine
        return self._groups[kind]

    def _members(self, kind: str) -> tuple[int, ...]:
        if self.serial:
            return (0,)
        group = self.expected.group_of(self.rank, kind)
        if group is None:
            raise UsageError(f"rank {self.rank} is in no group of kind {kind!r}")
        return tuple(group)

    # -- data -------------------------------------------------------------------------------
    def batch(self, step: int) -> Any:
        """The global batch of ``step`` (from 0): the same on every rank and in the serial twin.
        Split it the way your loader does (``ctx.local_rank("data_parallel")``, ...)."""
        if self._batch is None:
            raise UsageError("no batch= was given to assert_matches_serial, so ctx.batch is unset")
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1 + step)
            return self._batch(step)

    # -- capture ----------------------------------------------------------------------------
    def record(self, model: Any, **values: Any) -> None:
        """Capture this step: ``values`` (the loss and any logged number), every parameter's
        gradient and value. Collective for DTensor parameters: call it on every rank."""
        named = _named(model)
        reduced = self._reductions(model, named)
        grads = {n: self._capture(p.grad, p) for n, p in named.items() if p.grad is not None}
        if reduced is not None:
            grads = {n: replace(c, reduced=reduced.get(n, ())) for n, c in grads.items()}
        self._snapshots.append(
            Snapshot(
                values={k: self._capture(v) for k, v in values.items()},
                grads=grads,
                params={n: self._capture(p, p) for n, p in named.items()},
            )
        )

    def trail(self, final_model: Any) -> RankTrail:
        if final_model is None:
            raise UsageError(
                "the step function returned None; return the model (or a name -> parameter "
                "mapping) so its parameters after the last step can be compared"
            )
        named = _named(final_model)
        final = {n: self._capture(p, p) for n, p in named.items()}
        return RankTrail(self.rank, tuple(self._snapshots), final)

    def _capture(self, value: Any, param: Any = None) -> Captured:
        import torch

        if not isinstance(value, torch.Tensor):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise UsageError(
                    f"recorded values must be tensors or numbers, got {type(value).__name__}"
                ) from None
            value = torch.tensor(number, dtype=torch.float64)
        dtype = str(value.dtype).removeprefix("torch.")
        full_tensor = getattr(value, "full_tensor", None)
        tensor = full_tensor() if callable(full_tensor) else value
        # A floating tensor of 32 bits or fewer is exact in float32: half a float64 copy, which
        # matters when a world of ranks each hands back every full parameter and gradient.
        narrow = tensor.is_floating_point() and tensor.element_size() <= 4
        array = tensor.detach().to("cpu", torch.float32 if narrow else torch.float64)
        array = array.numpy().copy()
        return Captured(array, dtype, self._shard(param), _role(param))

    def _shard(self, param: Any) -> Shard | None:
        """Megatron-style tensor-parallel shards (``tensor_model_parallel``, ``partition_dim``)
        are plain tensors holding one tp slice; DTensors are gathered whole instead."""
        if param is None or self.serial or not getattr(param, "tensor_model_parallel", False):
            return None
        if hasattr(param, "full_tensor"):
            return None
        count = self.size("tensor")
        if count == 1:
            return None
        return Shard(int(getattr(param, "partition_dim", 0)), self.local_rank("tensor"), count)


def _role(param: Any) -> str | None:
    if param is None:
        return None
    if getattr(param, "allreduce", True) is False:
        return "expert"
    if getattr(param, "sequence_parallel", False):
        return "sequence_parallel"
    if getattr(param, "shared_embedding", False) or getattr(param, "shared", False):
        return "embedding"
    return None


def _named(model: Any) -> dict[str, Any]:
    if hasattr(model, "named_parameters"):
        pairs: Iterable[tuple[str, Any]] = model.named_parameters()
    elif isinstance(model, Mapping):
        pairs = model.items()
    else:
        raise UsageError(
            "record a torch.nn.Module (or a wrapper) or a mapping name -> parameter, got "
            f"{type(model).__name__}"
        )
    return {plain_name(n): p for n, p in pairs}


class _Named:
    """A name -> parameter mapping seen as a module (what the trace reads)."""

    def __init__(self, named: dict[str, Any]) -> None:
        self._named = named

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(self._named.items())

    def modules(self) -> Iterator[Any]:
        return iter(())  # no wrappers: the parameters are reduced by explicit collectives
