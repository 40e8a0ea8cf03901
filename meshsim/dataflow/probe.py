"""``DataflowProbe``: both data-flow checks bound to one reference, for use inside rank bodies.

What the ``meshsim_dataflow`` pytest fixture hands a ``@pytest.mark.meshsim`` test: it pickles
to every rank with its :class:`~meshsim.Expected`, and each method is collective (call it on
every rank), so a test needs no parent-side collection step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from meshsim.dataflow.data_check import assert_data_parallel
from meshsim.dataflow.grad_check import assert_gradient_sync, loss_scale
from meshsim.dataflow.records import BatchRecord, record_batches
from meshsim.errors import UsageError
from meshsim.model.expected import Expected


@dataclass(frozen=True)
class DataflowProbe:
    expected: Expected
    backend: str

    def __post_init__(self) -> None:
        if self.backend == "fake":
            raise UsageError(
                "the data-flow checks need real collectives and the fake backend moves no "
                "data; run this test with backend='threaded' or 'gloo'"
            )

    def record(self, batches: Iterable[Any] = (), **options: Any) -> BatchRecord:
        """This rank's record (see :func:`meshsim.record_batches`)."""
        return record_batches(batches, **options)

    def assert_batches(self, record: BatchRecord, **options: Any) -> None:
        """All-gather every rank's record and check it (collective)."""
        assert_data_parallel(record, self.expected, **options)

    def assert_gradients(self, model: Any) -> None:
        """:func:`meshsim.assert_gradient_sync` against this test's reference (collective)."""
        assert_gradient_sync(model, self.expected)

    def loss_scale(self) -> float:
        """This rank's loss multiplier (see :func:`meshsim.dataflow.loss_scale`)."""
        return loss_scale()
