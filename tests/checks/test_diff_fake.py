"""observe + diff on real DeviceMeshes built rank by rank on the fake backend (no harness)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import meshsim
from meshsim.checks import Observation, ObservedLayout, assert_layout, diff, format_ranks, observe
from meshsim.errors import LayoutMismatch, UsageError
from tests.fake_rank import as_fake_rank

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402


def observe_every_rank(world: int, build: Callable[[], DeviceMesh]) -> list[Observation]:
    out = []
    for rank in range(world):
        with as_fake_rank(rank, world):
            out.append(observe(build()))
    return out


def _mesh_dp_cp_tp() -> DeviceMesh:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    mesh["dp", "cp"]._flatten()
    return mesh


def test_correct_mesh_has_no_diff() -> None:
    observed = observe_every_rank(8, _mesh_dp_cp_tp)
    expected = meshsim.expect(
        "torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"), ops=["flatten dp,cp"]
    )
    assert diff(observed, expected) is None
    assert ObservedLayout.of(observed) == expected
    assert set(observed[3].groups) == {"dp", "cp", "tp", "dp_cp"}
    assert observed[3].groups["dp_cp"].members == (1, 3, 5, 7)
    assert observed[3].groups["dp_cp"].description == "mesh_dp_cp"
    assert observed[3].groups["tp"].gathered is None  # the fake backend cannot prove groups
    assert_layout(observed, expected)


def test_transposed_mesh_is_reported_per_kind_with_ranks() -> None:
    # A classic bug: ranks laid out column-major (tp strided) while the reference is row-major.
    def transposed() -> DeviceMesh:
        return DeviceMesh(
            "cpu", torch.arange(8).reshape(4, 2).T.contiguous(), mesh_dim_names=("dp", "tp")
        )

    observed = observe_every_rank(8, transposed)
    expected = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    found = diff(observed, expected)
    assert found is not None
    text = str(found)
    assert text.startswith("dp groups differ: expected [(0, 4), (1, 5), ... 2 more] observed ")
    assert "; 2 of 2 kinds checked differ (dp, tp) on 8 ranks" in text.splitlines()[0]
    assert "tp: ranks 0, 2 hold (0, 2, 4, 6); expected (0, 1, 2, 3)" in text
    # one line per distinct (expected, observed) pair, not one per rank
    assert len(found.mismatches) < 16
    with pytest.raises(LayoutMismatch, match=r"tp: ranks 0, 2 hold \(0, 2, 4, 6\)"):
        assert_layout(observed, expected)


def test_missing_and_unknown_kinds() -> None:
    observed = observe_every_rank(
        4, lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    )
    expected = meshsim.expect(
        "torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), ops=["flatten dp,tp"]
    )
    found = diff(observed, expected, kinds=["dp", "dp_tp"])
    assert found is not None and "dp_tp: ranks 0-3 have no group of this name" in str(found)
    other = meshsim.expect("torch", 4, mesh_shape=(4,), mesh_dim_names=("x",))
    with pytest.raises(UsageError, match="nothing to compare"):
        diff(observed, other)


def test_observe_rejects_unnamed_mesh_and_uninitialised_pg() -> None:
    with pytest.raises(UsageError, match="initialised default process group"):
        observe(None)  # type: ignore[arg-type]
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(UsageError, match="mesh_dim_names"):
            observe(init_device_mesh("cpu", (2, 2)))
    finally:
        dist.destroy_process_group()


def test_format_ranks() -> None:
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 3, 8, 10, 11]) == "ranks 0-3, 8, 10, 11"
