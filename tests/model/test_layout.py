"""Layout: row-major groups, per-rank queries, torch's slicing/flatten/unflatten rules."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshsim import Groups, Layout, LayoutError
from tests.model.strategies import layout_and_dims, layouts


# -- literal cases from the conventions notes ----------------------------------------------
def test_row_major_2d_groups() -> None:
    layout = Layout(dp=2, tp=4)
    assert layout.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.shape == (2, 4) and layout.world_size == 8


def test_constructor_forms_agree() -> None:
    assert Layout(pp=2, dp=4) == Layout([("pp", 2), ("dp", 4)]) == Layout({"pp": 2, "dp": 4})
    assert Layout.from_topology(["pipe", "data"], [2, 4]).groups("data") == Layout(
        pp=2, dp=4
    ).groups("dp")


def test_megatron_order_docstring_example() -> None:
    layout = Layout.from_order("tp-dp-pp", tp=2, dp=3, pp=4)
    dp = layout.groups("dp").to_tuples()
    assert dp[0] == (0, 2, 4) and dp[1] == (1, 3, 5) and dp[7] == (19, 21, 23)
    assert Layout.from_order("tp-cp-dp-pp", tp=2, cp=2, dp=2, pp=2) == Layout(
        pp=2, dp=2, cp=2, tp=2
    )


def test_megatron_order_appends_size_one_axes_and_rejects_bigger() -> None:
    layout = Layout.from_order("tp-dp", tp=2, dp=2, ep=1)
    assert layout.dim_names == ("ep", "dp", "tp")
    with pytest.raises(
        LayoutError, match=r"size of \(ep\) is \(2\).*haven't specified the order"
    ) as info:
        Layout.from_order("tp-dp", tp=2, dp=2, ep=2)
    assert info.value.upstream == "RuntimeError"
    with pytest.raises(LayoutError, match="names \\['cp'\\]"):
        Layout.from_order("tp-cp-dp", tp=2, dp=2)


def test_explicit_rank_tensor() -> None:
    layout = Layout.from_mesh([[0, 2], [1, 3]], names=("a", "b"))
    assert layout.groups("a") == [(0, 1), (2, 3)]
    assert layout.groups("b") == [(0, 2), (1, 3)]
    assert layout.coordinate(2) == {"a": 0, "b": 1}
    assert layout.rank(a=1, b=0) == 1
    assert layout.group_of(3, "b") == (1, 3) and layout.local_rank(3, "b") == 1


def test_non_adjacent_slice_keeps_root_order() -> None:
    layout = Layout(dp=2, pp=2, cp=2)
    sliced = layout["dp", "cp"]
    assert sliced.mesh_of(0).tolist() == [[0, 1], [4, 5]]
    assert sliced.mesh_of(2).tolist() == [[2, 3], [6, 7]]


def test_flatten_non_adjacent_dims() -> None:
    layout = Layout(dp=2, cp=2, tp=2)
    assert layout["dp", "cp"].flatten().groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout["dp", "tp"].flatten().groups() == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_flatten_registers_alias_on_root_and_caches() -> None:
    layout = Layout(dp=2, cp=2, tp=2)
    flat = layout["dp", "cp"].flatten()
    assert flat.dim_names == ("dp_cp",)
    root = flat.root()
    assert root["dp_cp"].groups() == flat.groups()
    assert root["dp_cp", "tp"].shape == (4, 2)
    again = root["dp", "cp"].flatten(name="dp_cp")
    assert again.groups() == flat.groups()
    with pytest.raises(
        LayoutError, match="Flatten mesh with mesh_dim_name dp_cp has been created before"
    ) as info:
        root["dp", "tp"].flatten(name="dp_cp")
    assert info.value.upstream == "ValueError"


def test_flatten_name_clashing_with_root_dim() -> None:
    with pytest.raises(LayoutError, match="tp already exists for submesh") as info:
        Layout(dp=2, cp=2, tp=2)["dp", "cp"].flatten(name="tp")
    assert info.value.upstream == "ValueError"


def test_flatten_of_flattened_alias_with_root_dim() -> None:
    layout = Layout(dp_replicate=2, dp_shard=2, cp=2)
    root = layout["dp_shard", "cp"].flatten(name="dp_shard_cp").root()
    dp = root["dp_replicate", "dp_shard_cp"].flatten(name="dp")
    assert dp.groups() == [tuple(range(8))]
    assert root["dp_replicate", "dp_shard_cp"].shape == (2, 4)


def test_flatten_all_dims_gives_global_rank() -> None:
    layout = Layout(a=2, b=3, c=2)
    flat = layout.flatten()
    assert all(flat.local_rank(r) == r for r in range(12))


def test_one_dim_flatten_into_own_name_returns_itself() -> None:
    layout = Layout(dp=4, tp=2)
    assert layout["dp"].flatten(name="dp") == layout["dp"]
    with pytest.raises(LayoutError, match="write flatten\\(name='dp_cp'\\)"):
        layout.flatten("dp_cp")


def test_slicing_rules() -> None:
    layout = Layout(dp=2, cp=2, tp=2)
    assert layout["dp", "cp", "tp"] is layout
    with pytest.raises(LayoutError, match="ascending order; use \\('dp', 'cp'\\)") as info:
        layout["cp", "dp"]
    assert info.value.upstream == "KeyError"
    with pytest.raises(LayoutError, match="Valid mesh_dim_names") as info:
        layout["zz"]
    assert info.value.upstream == "KeyError"
    flat = layout["dp", "cp"].flatten().root()
    with pytest.raises(LayoutError, match="overlapping") as info:
        flat["dp_cp", "cp"]
    assert info.value.upstream == "RuntimeError"
    # Only the root accepts flattened names.
    with pytest.raises(LayoutError, match="Valid mesh_dim_names"):
        flat["dp", "cp"]["dp_cp"]


def test_size_one_axes_do_not_count_for_slice_order() -> None:
    layout = Layout(a=2, b=1, c=4)
    assert layout["b", "a"].mesh_of(3).tolist() == [[3, 7]]


def test_unnamed_layout_cannot_slice_or_flatten() -> None:
    layout = Layout.from_mesh(np.arange(8).reshape(2, 4))
    assert layout.groups(1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for action in (lambda: layout["dim0"], lambda: layout.flatten()):
        with pytest.raises(LayoutError, match="without mesh_dim_names") as info:
            action()
        assert info.value.upstream == "RuntimeError"


def test_unflatten_rules() -> None:
    world = Layout(world=8)
    assert world.unflatten("world", (2, 4), ("dp", "tp")) == Layout(dp=2, tp=4)
    assert world.unflatten(0, (2, 2, 2), ("pp", "dp", "tp")).groups("dp") == [
        (0, 2),
        (1, 3),
        (4, 6),
        (5, 7),
    ]
    with pytest.raises(LayoutError, match="product") as info:
        world.unflatten("world", (2, 3), ("a", "b"))
    assert info.value.upstream == "ValueError"
    with pytest.raises(LayoutError, match="same length") as info:
        world.unflatten("world", (2, 4), ("a",))
    assert info.value.upstream == "RuntimeError"
    with pytest.raises(LayoutError, match="out of range"):
        world.unflatten(3, (2, 4), ("a", "b"))
    with pytest.raises(LayoutError, match="not in"):
        world.unflatten("nope", (2, 4), ("a", "b"))


def test_unflatten_of_flattened_dim_splits_in_root_order() -> None:
    layout = Layout(dp=2, cp=2, tp=2)
    flat = layout["dp", "tp"].flatten()
    split = flat.unflatten("dp_tp", (2, 2), ("x", "y"))
    assert split.groups("x") == layout.groups("dp")
    assert split.groups("y") == layout.groups("tp")


def test_two_unflattens_same_shape_same_groups_whatever_names() -> None:
    world = Layout(world=16)
    a = world.unflatten("world", (2, 4, 2), ("pp", "batch", "tp"))
    b = world.unflatten("world", (2, 4, 2), ("pp", "fsdp", "tp"))
    assert a.groups("batch") == b.groups("fsdp")


def test_bad_construction() -> None:
    with pytest.raises(LayoutError, match="at least one axis"):
        Layout()
    with pytest.raises(LayoutError, match="'dp' must have an integer size >= 1, got 0"):
        Layout(dp=0, tp=2)
    with pytest.raises(LayoutError, match="unique"):
        Layout([("dp", 2), ("dp", 2)])
    with pytest.raises(LayoutError, match="repeats ranks \\[1\\]"):
        Layout.from_mesh([[0, 1], [1, 2]], names=("a", "b"))
    with pytest.raises(LayoutError, match="same length"):
        Layout.from_mesh([[0, 1]], names=("a",))


def test_rank_and_filter() -> None:
    layout = Layout(pipe=2, data=2, model=2)
    assert layout.filter(pipe=0, data=1) == (2, 3)
    assert layout.rank(pipe=1, data=0, model=1) == 5
    with pytest.raises(LayoutError, match="missing \\['model'\\]"):
        layout.rank(pipe=1, data=0)
    with pytest.raises(LayoutError, match="not in this layout"):
        layout.coordinate(8)


# -- properties ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(layout_and_dims())
def test_groups_partition_the_world(case: tuple[Layout, tuple[str, ...]]) -> None:
    layout, dims = case
    groups = layout.groups(*dims)
    assert groups.is_partition_of(layout.world_size)
    assert groups.group_size == math.prod(layout.size_of(d) for d in dims)


@settings(max_examples=60, deadline=None)
@given(layout_and_dims())
def test_flatten_is_product_of_dims(case: tuple[Layout, tuple[str, ...]]) -> None:
    layout, dims = case
    flat = layout[dims].flatten(name="flat")
    assert flat.size == math.prod(layout.size_of(d) for d in dims)
    assert flat.groups() == layout.groups(*dims)


@settings(max_examples=60, deadline=None)
@given(layout_and_dims(), st.data())
def test_per_rank_queries_agree_with_groups(
    case: tuple[Layout, tuple[str, ...]], data: st.DataObject
) -> None:
    layout, dims = case
    rank = data.draw(st.integers(0, layout.world_size - 1))
    group = layout.group_of(rank, *dims)
    assert group in layout.groups(*dims).to_tuples()
    assert group[layout.local_rank(rank, *dims)] == rank
    assert layout.rank(**layout.coordinate(rank)) == rank


@settings(max_examples=60, deadline=None)
@given(layouts(max_axes=4), st.data())
def test_slicing_accepts_exactly_root_order(layout: Layout, data: st.DataObject) -> None:
    dims = data.draw(
        st.lists(st.sampled_from(layout.dim_names), min_size=1, max_size=3, unique=True)
    )
    positions = [layout.dim_names.index(d) for d in dims if layout.size_of(d) > 1]
    if positions == sorted(positions):
        assert layout[tuple(dims)].dim_names == tuple(dims)
    else:
        with pytest.raises(LayoutError, match="ascending order"):
            layout[tuple(dims)]


@settings(max_examples=40, deadline=None)
@given(layouts(max_axes=3), st.data())
def test_unflatten_undoes_flatten(layout: Layout, data: st.DataObject) -> None:
    flat = layout.flatten(name="all")
    back = flat.unflatten("all", layout.shape, tuple(f"n_{d}" for d in layout.dim_names))
    for dim in layout.dim_names:
        assert back.groups(f"n_{dim}") == layout.groups(dim)


def test_groups_equality_ignores_group_order_not_member_order() -> None:
    assert Groups([(0, 1), (2, 3)]) == Groups([(2, 3), (0, 1)])
    assert Groups([(0, 1), (2, 3)]) != Groups([(1, 0), (2, 3)])
    assert Groups([(0, 1)]).local_rank(1) == 1 and Groups([(0, 1)]).group_of(5) is None


def test_every_permutation_of_dims_gives_root_ordered_groups() -> None:
    layout = Layout(a=2, b=3, c=2)
    reference = layout.groups("a", "c")
    for perm in itertools.permutations(("a", "c")):
        assert layout.groups(*perm) == reference
