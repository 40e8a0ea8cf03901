"""Live checks: observe what ranks built, prove it by communication, diff it with the reference."""

from meshsim.checks.agreement import (
    Disagreement,
    MeshView,
    assert_meshes_agree,
    check_meshes,
)
from meshsim.checks.assertions import assert_layout, assert_within_nodes, gather
from meshsim.checks.diff import MeshDiff, Mismatch, ObservedLayout, diff, format_ranks
from meshsim.checks.observation import GroupView, Observation
from meshsim.checks.snapshot import observe, observe_groups

__all__ = [
    "Disagreement",
    "GroupView",
    "MeshDiff",
    "MeshView",
    "Mismatch",
    "Observation",
    "ObservedLayout",
    "assert_layout",
    "assert_meshes_agree",
    "assert_within_nodes",
    "check_meshes",
    "diff",
    "format_ranks",
    "gather",
    "observe",
    "observe_groups",
]
