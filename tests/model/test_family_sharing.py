"""One ``Groups`` object per family of groups, shared by every layout that makes it.

A world-1,024 sweep examines tens of thousands of layouts that make a few hundred distinct
families; the answers a family gives (canonical rows, partition, local ranks, fingerprint
digests) are worked out once per family. Sharing must never change an answer: a family is
keyed by what decides its rows row for row, and anything else is not shared.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshsim.model.conventions._areal_held import HeldGroups
from meshsim.model.expected import Kind
from meshsim.model.groups import FAMILIES, Groups
from meshsim.model.layout import Layout

from .strategies import layouts


def _unshared(layout: Layout, *dims: str) -> np.ndarray:
    return layout.groups_array(*dims)


@settings(max_examples=200, deadline=None)
@given(layouts(max_world=256), st.data())
def test_shared_families_hold_exactly_the_rows_of_their_layout(layout: Layout, data) -> None:
    """Row for row and in order (not only as a set): ``group_of`` and the examples in
    findings read rows in order."""
    dims = data.draw(st.sets(st.sampled_from(layout.dim_names), min_size=1))
    spanned = tuple(d for d in layout.dim_names if d in dims)
    assert np.array_equal(layout.groups(*spanned).array, _unshared(layout, *spanned))
    # the same family reached through an unflattened world, a flattened alias, a slice
    world = Layout(world=layout.world_size).unflatten("world", layout.root_shape, layout.root_names)
    assert np.array_equal(world.groups(*spanned).array, _unshared(layout, *spanned))


def test_layouts_making_the_same_family_share_one_object() -> None:
    tp = Layout(pp=2, dp=4, tp=2).groups("tp")
    assert Layout(dp=8, tp=2).groups("tp") is tp  # size-1 and other outer axes aside
    assert Layout(world=16).unflatten("world", (8, 2), ("dp", "tp")).groups("tp") is tp
    assert Layout(dp=8, cp=2).groups("cp") is tp  # names play no part
    assert Layout(tp=2, dp=8).groups("tp") is not tp  # another family: (0, 8), (1, 9), ...


def test_the_order_inside_a_group_keeps_families_apart() -> None:
    """``(0, 1, 2, 3)`` and ``(0, 2, 1, 3)`` hold the same ranks in another local order."""
    row_major = Layout(a=2, b=2).groups("a", "b")
    swapped = Layout(b=2, a=2).unflatten("b", (2,), ("b",))
    by_columns = Layout.from_mesh(np.arange(4).reshape(2, 2).T, ["a", "b"]).groups("a", "b")
    assert row_major.array.tolist() == [[0, 1, 2, 3]]
    assert by_columns.array.tolist() == [[0, 2, 1, 3]]
    assert by_columns is not row_major
    assert swapped.groups("b", "a").array.tolist() == [[0, 1, 2, 3]]


def test_a_grid_that_is_not_strided_is_answered_from_its_own_ranks() -> None:
    layout = Layout.from_mesh([[0, 3], [1, 2]], ["x", "y"])
    assert layout.groups("y").array.tolist() == [[0, 3], [1, 2]]
    assert layout.groups("x").array.tolist() == [[0, 1], [3, 2]]
    assert Layout.from_mesh([[0, 3], [2, 1]], ["x", "y"]).groups("y").array.tolist() == [
        [0, 3],
        [2, 1],
    ]


def test_answers_are_kept_with_the_family_and_read_only() -> None:
    groups = Layout(dp=4, tp=2).groups("dp")
    local = groups.local_ranks(8)
    assert groups.local_ranks(8) is local
    assert local.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="read-only"):
        local[0] = 5
    with pytest.raises(ValueError, match="read-only"):
        groups.canonical()[0, 0] = 5
    assert groups.is_partition_of(8) and not groups.is_partition_of(16)


def test_explicit_rows_are_shared_by_content_through_their_kind() -> None:
    first = Kind("a", "", lambda: Groups([(0, 1), (2, 3)])).groups()
    again = Kind("b", "", lambda: Groups([(0, 1), (2, 3)])).groups()
    other = Kind("c", "", lambda: Groups([(0, 2), (1, 3)])).groups()
    assert again is first and other is not first


def test_groups_whose_holders_matter_are_never_shared() -> None:
    rows = [(0, 1), (2, 3)]
    held = HeldGroups(rows, np.array([0, 0, -1, 1]))
    assert FAMILIES.share(held) is held
    assert Kind("h", "", lambda: held).groups().local_ranks(4).tolist() == [0, 1, -1, 1]
    assert Kind("p", "", lambda: Groups(rows)).groups().local_ranks(4).tolist() == [0, 1, 0, 1]


def test_families_of_huge_worlds_are_not_kept() -> None:
    """A family of a 262,144-rank world (2 MiB of rows) is answered, never kept: hashing and
    holding such families would cost more than their answers save."""
    big = Layout(dp=2, tp=1 << 17)
    tp = big.groups("tp")
    assert tp.array.shape == (2, 1 << 17) and tp.array[1, 0] == 1 << 17
    assert big.groups("tp") is not tp
    assert Kind("k", "", lambda: Groups(big.groups_array("dp"))).groups().group_size == 2


def test_the_table_keeps_to_its_budget() -> None:
    from meshsim.model.groups import FamilyTable

    table = FamilyTable(kept=3, budget=1 << 20)
    made = [table.get(n, lambda n=n: Groups([(n, n + 1)])) for n in range(5)]
    assert table.get(4, lambda: Groups([(9, 9)])) is made[4]  # kept
    assert table.get(0, lambda: Groups([(0, 1)])) is not made[0]  # the oldest went
    small = FamilyTable(budget=64)  # room for four 16-byte families
    firsts = [small.get(n, lambda n=n: Groups([(n, n + 1)])) for n in range(5)]
    assert small.get(1, lambda: Groups([(1, 2)])) is firsts[1]
    assert small.get(0, lambda: Groups([(0, 1)])) is not firsts[0]  # past the budget: gone


def test_answers_about_two_families_are_kept_per_pair() -> None:
    """Containment and local-rank agreement depend on both families: kept with the first,
    keyed by the second's serial, never confused between two seconds."""
    from meshsim.model.invariants import peers_with_different_local_rank, uncontained_groups

    layout = Layout(dp=2, tp=4)
    data, tensor, both = layout.groups("dp"), layout.groups("tp"), layout.groups("dp", "tp")
    assert len(uncontained_groups(data, both, 8)) == 0
    assert len(uncontained_groups(data, tensor, 8)) == 4  # each (r, r + 4) spans two tp groups
    assert uncontained_groups(data, tensor, 8) is uncontained_groups(data, tensor, 8)
    assert len(uncontained_groups(data, both, 8)) == 0  # the other pair's answer is its own
    reversed_rows = Groups([tuple(4 * g + 3 - i for i in range(4)) for g in range(2)])
    assert len(peers_with_different_local_rank(data, tensor, 8)) == 0
    assert len(peers_with_different_local_rank(data, reversed_rows, 8)) == 0
    assert len(peers_with_different_local_rank(tensor, both, 8)) == 2
    assert data.serial != tensor.serial != both.serial


def test_new_grids_share_one_read_only_world() -> None:
    """Every ``Layout(...)`` of N ranks is a view of one read-only ``0..N-1``: a sweep builds
    tens of thousands of them, which at 131,072 ranks were 1 MiB each."""
    first, second = Layout(dp=4, tp=2), Layout(pp=2, dp=2, tp=2)
    assert np.shares_memory(first.mesh, second.mesh)
    assert not first.mesh.flags.writeable and not second.mesh.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first.mesh[0, 0] = 7
    assert second.mesh.ravel().tolist() == list(range(8))
    assert np.array_equal(first.rank_map(), np.arange(8))
