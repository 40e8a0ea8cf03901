"""A mismatch at world 64 reads as one summary per kind, not one line per rank."""

from __future__ import annotations

import numpy as np
import pytest

import meshsim
from meshsim.checks import Observation, diff
from meshsim.checks.observation import GroupView
from meshsim.errors import LayoutMismatch


def _transposed_observations(world: int, rows: int) -> list[Observation]:
    """Every rank's view of a (dp, tp) mesh laid out column-major (the classic stride bug)."""
    grid = np.arange(world).reshape(world // rows, rows).T  # shape (rows, world // rows)
    out = []
    for rank in range(world):
        r, c = (int(x[0]) for x in np.nonzero(grid == rank))
        tp, dp = tuple(grid[r].tolist()), tuple(grid[:, c].tolist())
        views = {
            "dp": GroupView("dp", dp, dp.index(rank)),
            "tp": GroupView("tp", tp, tp.index(rank)),
        }
        out.append(Observation(rank, world, "fake", views))
    return out


def test_world_64_mismatch_is_summarised_once_per_kind() -> None:
    expected = meshsim.expect("torch", 64, mesh_shape=(4, 16), mesh_dim_names=("dp", "tp"))
    found = diff(_transposed_observations(64, 4), expected)
    assert found is not None
    assert found.kinds() == ["dp", "tp"] and found.ranks_affected() == tuple(range(64))
    lines = found.lines()
    assert lines[0].startswith(
        "dp groups differ: expected [(0, 16, 32, 48), (1, 17, 33, 49), ... 14 more] observed "
        "[(0, 1, 2, 3), (4, 5, 6, 7), ... 14 more] on ranks 0-63; "
        "2 of 2 kinds checked differ (dp, tp) on 64 ranks"
    )
    summaries = [line for line in lines if line.startswith("  dp: 64 ranks in the wrong group")]
    assert len(summaries) == 1
    assert "expected [(0, 16, 32, 48), (1, 17, 33, 49)" in summaries[0]
    assert "observed [(0, 1, 2, 3), (4, 5, 6, 7)" in summaries[0]
    assert sum(line.startswith("  tp: 64 ranks in the wrong group") for line in lines) == 1
    assert len(lines) <= 1 + 2 * (1 + 4 + 1)  # bounded by kinds, not by ranks
    assert "    ... 60 more for dp" in lines
    with pytest.raises(LayoutMismatch) as raised:
        meshsim.assert_layout(_transposed_observations(64, 4), expected)
    text = str(raised.value)
    assert text == str(found) and text.count("dp: 64 ranks in the wrong group") == 1
    assert raised.value.diff == found


def test_single_mismatch_keeps_its_one_line() -> None:
    expected = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    observations = _transposed_observations(4, 2)
    good = {o.rank: o for o in observations}
    fixed = [
        Observation(o.rank, 4, "fake", {"tp": GroupView("tp", *_ok_tp(o.rank))})
        for o in good.values()
    ]
    fixed[3] = Observation(3, 4, "fake", {"tp": GroupView("tp", (1, 3), 1)})
    found = diff(fixed, expected)
    assert found is not None
    assert found.lines()[1:] == ["  tp: rank 3 holds (1, 3); expected (2, 3)"]


def _ok_tp(rank: int) -> tuple[tuple[int, ...], int]:
    group = (0, 1) if rank < 2 else (2, 3)
    return group, group.index(rank)
