"""structure_of: the sizes and strides that rebuild a family of groups, and its formula."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from meshsim.model import Layout, expect
from meshsim.model.groups import Groups
from meshsim.model.structure import Strided, structure_of
from tests.model.strategies import layout_and_dims


def rebuilt(groups: Groups) -> Groups:
    """The groups the structure describes, from its numbers alone (as a JSON reader would)."""
    found = structure_of(groups)
    assert found is not None
    starts = Strided(found.starts.first, found.starts.sizes, found.starts.strides).ranks()
    return Groups(starts[:, None] + found.members.ranks()[None, :])


def test_megatron_tp_and_dp_read_as_formulas() -> None:
    layout = Layout.from_order("tp-dp", tp=2, dp=4)
    tp = structure_of(layout.groups("tp"))
    assert tp is not None and tp.formula() == "ranks r + i (i < 2) for r = 2a (a < 4)"
    dp = structure_of(layout.groups("dp"))
    assert dp is not None and dp.formula() == "ranks r + 2i (i < 4) for r < 2"
    assert dp.to_json() == {
        "members": {"sizes": [4], "strides": [2]},
        "starts": {"first": 0, "sizes": [2], "strides": [1]},
        "formula": "ranks r + 2i (i < 4) for r < 2",
    }


def test_two_level_starts_and_a_single_group() -> None:
    groups = Groups([(0, 2), (1, 3), (4, 6), (5, 7)])
    found = structure_of(groups)
    assert found is not None
    assert found.formula() == "ranks r + 2i (i < 2) for r = 4a + b (a < 2, b < 2)"
    assert (found.starts.sizes, found.starts.strides) == ((2, 2), (4, 1))
    whole = structure_of(Groups([tuple(range(0, 16, 4))]))
    assert whole is not None and whole.formula() == "ranks 4i (i < 4)"
    alone = structure_of(Groups([(3,)]))
    assert alone is not None and alone.formula() == "ranks 3"


def test_member_order_is_kept_even_when_it_runs_backwards() -> None:
    groups = Groups([(1, 0), (3, 2)])  # local rank 0 is the higher rank
    found = structure_of(groups)
    assert found is not None and found.members.strides == (-1,)
    assert found.formula() == "ranks r - i (i < 2) for r = 1 + 2a (a < 2)"
    assert rebuilt(groups) == groups


def test_no_formula_for_groups_no_strides_give() -> None:
    assert structure_of(Groups([(0, 4, 12), (1, 5, 13)])) is None  # offsets 0, 4, 12
    assert structure_of(Groups([(0, 1), (2, 4)])) is None  # two different patterns
    assert structure_of(Groups([(0, 1), (2, 3), (6, 7)])) is None  # starts 0, 2, 6
    assert structure_of(Groups([])) is None


@settings(max_examples=25, deadline=None)
@given(layout_and_dims())
def test_every_layout_dim_rebuilds_from_its_structure(case: tuple[Layout, tuple[str, ...]]) -> None:
    """Any dim (or flattened set of dims) of a row-major layout is strided: the structure
    exists and rebuilds the very groups, in local-rank order."""
    layout, dims = case
    groups = layout.groups(*dims)
    assert rebuilt(groups) == groups


def test_megatron_at_131072_ranks_is_described_without_listing() -> None:
    expected = expect("megatron", 1 << 17, tensor_model_parallel_size=8)
    for name in ("tp", "dp", "pp"):
        groups = expected.groups(name)
        found = structure_of(groups)
        assert found is not None, name
        count = int(np.prod(found.starts.sizes, dtype=np.int64))
        assert count == len(groups), name
    tp = structure_of(expected.groups("tp"))
    assert tp is not None and tp.formula() == "ranks r + i (i < 8) for r = 8a (a < 16384)"
