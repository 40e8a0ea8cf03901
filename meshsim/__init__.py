"""meshsim: prove parallel-training rank layouts right, on a laptop and in CI."""

from meshsim.checks import (
    MeshDiff,
    Observation,
    ObservedLayout,
    assert_layout,
    diff,
    observe,
    observe_groups,
)
from meshsim.dataflow import (
    BatchRecord,
    assert_data_parallel,
    assert_gradient_sync,
    record_batches,
)
from meshsim.errors import (
    CollectiveDivergence,
    DataflowMismatch,
    LayoutError,
    LayoutMismatch,
    MeshsimError,
    NotEnoughGPUs,
    RankFailure,
    RankTimeout,
    TeardownWarning,
    UsageError,
)
from meshsim.harness import RankContext, RankOutcome, RunResult, context, run, shutdown
from meshsim.model import (
    CONVENTIONS,
    ROLES,
    Expected,
    Groups,
    Kind,
    Layout,
    LayoutCase,
    expect,
    layouts,
)

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS",
    "ROLES",
    "BatchRecord",
    "CollectiveDivergence",
    "DataflowMismatch",
    "Expected",
    "Groups",
    "Kind",
    "Layout",
    "LayoutCase",
    "LayoutError",
    "LayoutMismatch",
    "MeshDiff",
    "MeshsimError",
    "NotEnoughGPUs",
    "Observation",
    "ObservedLayout",
    "RankContext",
    "RankFailure",
    "RankOutcome",
    "RankTimeout",
    "RunResult",
    "TeardownWarning",
    "UsageError",
    "assert_data_parallel",
    "assert_gradient_sync",
    "assert_layout",
    "context",
    "diff",
    "expect",
    "layouts",
    "observe",
    "observe_groups",
    "record_batches",
    "run",
    "shutdown",
]
