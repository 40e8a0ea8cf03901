"""Invariant checks catch the layouts that fail silently in training."""

from __future__ import annotations

import pytest

import meshsim
from meshsim import Groups, Layout, LayoutError
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.invariants import (
    crossing_groups,
    find_violations,
    is_contained,
    node_crossings,
    peers_with_different_local_rank,
    pipeline_neighbors_mismatch,
    uncontained_groups,
    validate_invariants,
)


def _expected(kinds: list[Kind], roles: dict[str, str], world: int = 8) -> Expected:
    return Expected("test", world, {}, kinds, roles)


def test_containment() -> None:
    data = Groups([(0, 2), (1, 3), (4, 6), (5, 7)])
    grad = Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert is_contained(data, grad, 8)
    split = Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert uncontained_groups(split, grad, 8) == split


def test_tp_peers_fed_different_batches_are_caught() -> None:
    layout = Layout(dp=2, tp=4)
    data = layout.groups("dp")
    assert len(peers_with_different_local_rank(layout.groups("tp"), data, 8)) == 0
    # A wrong data-parallel grouping: consecutive ranks, so TP peers hold different dp ranks.
    wrong_data = Groups([(0, 1), (2, 3), (4, 5), (6, 7)])
    bad = peers_with_different_local_rank(layout.groups("tp"), wrong_data, 8)
    assert bad == layout.groups("tp")


def test_node_crossing_tp() -> None:
    layout = Layout(dp=2, tp=8)
    assert len(crossing_groups(layout.groups("tp"), gpus_per_node=8)) == 0
    assert crossing_groups(layout.groups("tp"), gpus_per_node=4) == layout.groups("tp")
    expected = meshsim.expect("torch", 16, mesh_shape=(2, 8), mesh_dim_names=("dp", "tp"))
    crossings = node_crossings(expected, gpus_per_node=8)
    assert set(crossings) == {"dp"} and len(crossings["dp"]) == 8
    with pytest.raises(LayoutError, match="gpus_per_node must be >= 1"):
        crossing_groups(layout.groups("tp"), 0)


def test_correct_torch_layout_has_no_violations() -> None:
    expected = meshsim.expect(
        "torch",
        16,
        mesh_shape=(2, 2, 2, 2),
        mesh_dim_names=("pp", "dp", "cp", "tp"),
        ops=["flatten dp,cp"],
    )
    assert find_violations(expected) == []
    validate_invariants(expected)


def test_broken_layout_reports_each_violation() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    kinds = [
        layout_kind(layout, "tp", "tp", "tp"),
        # pipelines pairing ranks with different tp positions.
        Kind("pp", "wrong", Groups([(0, 5), (1, 4), (2, 7), (3, 6)])),
        # gradient reduction over pp instead of dp: does not contain the dp groups.
        layout_kind(layout, "grad", "wrong", "pp"),
        # data parallel over consecutive ranks: tp peers load different batches.
        Kind("dp", "wrong", Groups([(0, 1), (2, 3), (4, 5), (6, 7)])),
        Kind("holes", "not a partition", Groups([(0, 1)])),
    ]
    roles = {"tensor": "tp", "pipeline": "pp", "gradient_reduce": "grad", "data_parallel": "dp"}
    found = find_violations(_expected(kinds, roles))
    checks = {v.check for v in found}
    assert "partition" in checks
    assert "gradient_reduce ⊇ data_parallel" in checks
    assert "tensor peers share the data-parallel rank" in checks
    assert "pipeline neighbours" in checks
    with pytest.raises(LayoutError, match=r"breaks .* invariant"):
        validate_invariants(_expected(kinds, roles))


def test_pipeline_neighbours_must_differ_only_in_stage() -> None:
    layout = Layout(pp=2, tp=2)
    good = _expected(
        [layout_kind(layout, "pp", "", "pp"), layout_kind(layout, "tp", "", "tp")],
        {"pipeline": "pp", "tensor": "tp"},
        world=4,
    )
    assert pipeline_neighbors_mismatch(good) == []
    crossed = _expected(
        [Kind("pp", "", Groups([(0, 3), (1, 2)])), layout_kind(layout, "tp", "", "tp")],
        {"pipeline": "pp", "tensor": "tp"},
        world=4,
    )
    assert pipeline_neighbors_mismatch(crossed)
    assert crossed.pipeline_neighbors(3) == (0, 0)
