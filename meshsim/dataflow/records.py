"""What one rank loaded, step by step: the input of :func:`meshsim.assert_data_parallel`.

Ranks record plain data (sample ids and chunk labels, never tensors), so a record pickles
across the gloo tier's process boundary and costs nothing to compare in the parent. A tensor
batch is reduced to one fingerprint per sample (its rows along dim 0), so two ranks that
loaded the same rows agree without shipping the rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshsim.dataflow.evidence import held_mesh_groups
from meshsim.errors import UsageError

SampleId = Hashable


@dataclass(frozen=True)
class Step:
    """One step on one rank: the samples in loader order, the sequence chunk (if recorded)."""

    samples: tuple[SampleId, ...]
    chunk: Hashable | None = None
    epoch: int = 0


@dataclass
class BatchRecord:
    """The batches one rank loaded. ``add`` one step at a time, or build with ``record_batches``.

    ``rank`` defaults to the caller's ``torch.distributed`` rank when recorded inside a run.
    """

    rank: int
    steps: list[Step] = field(default_factory=list)
    #: The mesh groups the rank held when recorded (dim name -> member lists), the evidence
    #: that lets a hint tell a wrong mesh from a wrong loader.
    mesh_groups: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def add(self, batch: Any, *, chunk: Any = None, epoch: int = 0) -> BatchRecord:
        """Record one step: ``batch`` is sample ids or a tensor whose rows are the samples.

        ``chunk`` says which part of each sequence this rank holds (``(start, stop)``, a
        chunk index, or a position tensor, fingerprinted): context-parallel peers must hold
        the same samples and different chunks. ``epoch`` bounds the no-repeat check.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise UsageError(f"epoch must be an int >= 0, got {epoch!r}")
        label = None if chunk is None else _label(chunk)
        self.steps.append(Step(sample_ids(batch), label, epoch))
        return self


def record_batches(
    batches: Iterable[Any] = (),
    *,
    chunks: Sequence[Any] | None = None,
    epochs: Sequence[int] | None = None,
    rank: int | None = None,
) -> BatchRecord:
    """This rank's :class:`BatchRecord` of ``batches`` (one item per step; may be empty).

    Call it on every rank with what that rank's loader yielded (sample ids, or tensors that
    are fingerprinted row by row) and return it from the rank; pass the records of all ranks
    to :func:`meshsim.assert_data_parallel`. ``chunks`` / ``epochs`` give, per step, the
    sequence chunk this rank holds and the epoch of the step.
    """
    record = BatchRecord(_this_rank() if rank is None else _check_rank(rank))
    record.mesh_groups = held_mesh_groups()
    items = list(batches)
    for name, extra in (("chunks", chunks), ("epochs", epochs)):
        if extra is not None and len(extra) != len(items):
            raise UsageError(f"{name} has {len(extra)} entries for {len(items)} steps")
    for index, batch in enumerate(items):
        record.add(
            batch,
            chunk=None if chunks is None else chunks[index],
            epoch=0 if epochs is None else epochs[index],
        )
    return record


def sample_ids(batch: Any) -> tuple[SampleId, ...]:
    """Sample ids as given, or one fingerprint per row of a tensor / array batch."""
    if hasattr(batch, "detach") and hasattr(batch, "shape"):  # torch.Tensor (and DTensor)
        tensor = batch.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if tensor.dim() == 0:
            raise UsageError("a tensor batch needs a sample dimension (dim 0), got a scalar")
        return tuple(_fingerprint(row) for row in tensor.cpu().contiguous().unbind(0))
    if hasattr(batch, "shape") and hasattr(batch, "tobytes"):  # numpy
        if len(batch.shape) == 0:
            raise UsageError("an array batch needs a sample dimension (dim 0), got a scalar")
        return tuple(_fingerprint(row) for row in batch)
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
        raise UsageError(
            "a batch is a sequence of sample ids or a tensor of samples, got "
            f"{type(batch).__name__}"
        )
    ids = tuple(_plain(item) for item in batch)
    return ids


def _plain(item: Any) -> SampleId:
    if hasattr(item, "item") and getattr(item, "shape", None) in ((), []):
        return item.item()  # a 0-d tensor / numpy scalar id
    return _key(item, "sample id", "")


def _label(chunk: Any) -> Hashable:
    hint = "; give a tuple, an int or a tensor"
    return _key(tuple(chunk) if isinstance(chunk, list) else chunk, "chunk", hint)


def _key(value: Any, what: str, hint: str) -> Hashable:
    """``value`` as a dict key: a tensor or array by its content, anything else as it is."""
    if hasattr(value, "shape"):
        return _fingerprint(value)
    if not isinstance(value, Hashable):
        raise UsageError(f"{what} {value!r} is not hashable{hint}")
    return value


def _fingerprint(row: Any) -> str:
    """Content hash of one sample (dtype, shape and bytes): equal rows, equal fingerprints."""
    if hasattr(row, "numpy"):
        row = row.detach().cpu().contiguous().numpy()
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{row.dtype}{tuple(row.shape)}".encode())
    digest.update(row.tobytes())
    return "#" + digest.hexdigest()


def _this_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        dist = None
    if dist is None or not dist.is_initialized():
        raise UsageError(
            "record_batches(rank=None) reads the rank from torch.distributed, which is not "
            "initialised here; call it inside meshsim.run, or pass rank="
        )
    return int(dist.get_rank())


def _check_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UsageError(f"rank must be an int >= 0, got {rank!r}")
    return rank
