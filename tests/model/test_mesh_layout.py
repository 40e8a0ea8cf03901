"""meshsim's layout algebra against torch's own ``_MeshLayout`` / ``_FlatLayout``.

Property-based: random sizes and strides go through both, and every answer (normalised modes,
composition, complement, global ranks, remap_to_tensor, the checks) and every rejection (torch's
AssertionError is meshsim's LayoutError with ``upstream="AssertionError"``) must agree. Then
``Layout.mesh_layout`` against the ``_layout`` real DeviceMesh objects hold after random
``_flatten``/``_unflatten`` chains on the fake backend.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import Layout, LayoutError
from meshsim.model.mesh_layout import FlatLayout, MeshLayout, coalesce
from tests.model.strategies import layouts

torch = pytest.importorskip("torch")
try:
    import torch.distributed._mesh_layout as tl
except ImportError:  # torch < 2.10
    tl = None
#: The tests against torch need its CuTe layout as of 2.13 (``_FlatLayout`` axes); 2.10-2.12
#: kept one ``_MeshLayout`` per dim with another API, older releases a rank tensor per view.
needs_cute = pytest.mark.skipif(
    not hasattr(tl, "_FlatLayout"),
    reason=f"torch {torch.__version__} has no CuTe _FlatLayout (torch >= 2.13)",
)

SETTINGS = settings(max_examples=200, deadline=None)

modes = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 48)), min_size=0, max_size=4)
positive_modes = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 48)), min_size=1, max_size=4)
sizes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


def _flat(pairs: list[tuple[int, int]]) -> tuple[FlatLayout, Any]:
    shape = tuple(s for s, _ in pairs)
    stride = tuple(d for _, d in pairs)
    return FlatLayout(shape, stride), tl._FlatLayout(shape, stride)


def _same(ours: FlatLayout | MeshLayout, theirs: Any) -> None:
    if isinstance(ours, FlatLayout):
        assert (ours.shape, ours.stride) == (tuple(theirs.shape), tuple(theirs.stride))
    else:
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _same(a, b)


def _agree(ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[Any, Any] | None:
    """Both succeed (their results returned) or both reject, with the same exception type."""
    try:
        expected = theirs()
    except Exception as error:
        with pytest.raises(LayoutError) as caught:
            ours()
        assert caught.value.upstream == type(error).__name__, (error, caught.value)
        return None
    return ours(), expected


@needs_cute
@SETTINGS
@given(modes)
def test_normalised_modes_numel_cosize_and_checks(pairs: list[tuple[int, int]]) -> None:
    ours, theirs = _flat(pairs)
    _same(ours, theirs)
    assert ours.numel() == theirs.numel()
    assert ours.check_sorted() == theirs.check_sorted()
    assert coalesce(pairs) == ours.modes
    if all(d > 0 for s, d in ours.modes):  # torch divides by zero on a stride-0 mode
        assert ours.check_orthogonal() == theirs.check_orthogonal()
    assert ours.all_ranks_from_zero() == theirs.all_ranks_from_zero()


@needs_cute
@SETTINGS
@given(modes, st.integers(1, 300))
def test_complement_and_global_ranks(pairs: list[tuple[int, int]], world: int) -> None:
    ours, theirs = _flat(pairs)
    both = _agree(lambda: ours.complement(world), lambda: theirs.complement(world))
    if both is not None:
        _same(*both)
        assert ours.global_ranks(world).tolist() == theirs.global_ranks(world)


@needs_cute
@SETTINGS
@given(positive_modes, st.lists(sizes, min_size=1, max_size=3), st.booleans())
def test_composition(pairs: list[tuple[int, int]], axes: list[list[int]], strided: bool) -> None:
    ours, theirs = _flat(pairs)
    # The right operand: from_sizes_strides (what _unflatten composes with) or arbitrary modes.
    if strided:
        inner = [tuple(zip(a, a[::-1])) for a in axes]
        ours_b = MeshLayout(FlatLayout(*zip(*m)) for m in inner)
        theirs_b = tl._MeshLayout([tl._FlatLayout(*zip(*m)) for m in inner])
    else:
        flat = [s for a in axes for s in a]
        ours_b = MeshLayout.from_sizes_strides(flat)
        theirs_b = tl._MeshLayout.from_sizes_strides(tuple(flat))
    both = _agree(lambda: ours.composition(ours_b), lambda: theirs.composition(theirs_b))
    if both is not None:
        _same(*both)


@needs_cute
@settings(max_examples=100, deadline=None)
@given(st.lists(positive_modes, min_size=1, max_size=3), st.integers(0, 3), st.randoms())
def test_mesh_layout_collapse_splice_remap(
    axes: list[list[tuple[int, int]]], extra: int, rng: random.Random
) -> None:
    ours = MeshLayout(_flat(a)[0] for a in axes)
    theirs = tl._MeshLayout([_flat(a)[1] for a in axes])
    _same(ours, theirs)
    _same(ours.collapse(), theirs.collapse())
    assert ours.top_level_sizes == theirs.top_level_sizes
    assert ours.cosize() == theirs.cosize()
    _same(ours.splice(0, 1, ours[1:]), theirs.splice(0, 1, theirs[1:]))  # type: ignore[arg-type]
    world = ours.cosize() + extra
    permuted = list(range(world))
    rng.shuffle(permuted)
    for rank_map in (list(range(world)), permuted):
        both = _agree(
            lambda rm=rank_map: ours.remap_to_tensor(rm),
            lambda rm=rank_map: theirs.remap_to_tensor(torch.tensor(rm)),
        )
        if both is not None:
            assert both[0].tolist() == both[1].tolist()


@needs_cute
@SETTINGS
@given(sizes, st.data())
def test_unflatten_is_composition_then_splice(mesh: list[int], data: st.DataObject) -> None:
    ours = MeshLayout.from_sizes_strides(mesh)
    theirs = tl._MeshLayout.from_sizes_strides(tuple(mesh))
    flat_ours = MeshLayout([ours.collapse()])
    dim = data.draw(st.integers(0, len(mesh) - 1))
    split = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    if math.prod(split) != mesh[dim]:
        with pytest.raises(LayoutError, match="The product of") as caught:
            ours.unflatten(dim, split)
        assert caught.value.upstream == "ValueError"
        return
    inner = tl._MeshLayout.from_sizes_strides(tuple(split))
    expected = theirs.splice(dim, dim + 1, theirs[dim].composition(inner))
    _same(ours.unflatten(dim, split), expected)
    assert flat_ours.unflatten(0, mesh) == ours


def test_worked_examples() -> None:
    """The examples a reader can check by hand."""
    assert FlatLayout((2, 4), (4, 1)).modes == ((8, 1),)
    assert FlatLayout(2, 2).complement(8) == FlatLayout((2, 2), (4, 1))
    assert FlatLayout(2, 2).global_ranks(8).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert str(MeshLayout.from_sizes_strides((2, 4))) == "((2,):(4,), (4,):(1,))"
    assert not FlatLayout((2, 3), (2, 1)).check_orthogonal()
    with pytest.raises(LayoutError, match="do not divide") as caught:
        FlatLayout((2, 3), (6, 1)).composition(MeshLayout.from_sizes_strides((3, 2)))
    assert caught.value.upstream == "AssertionError"


# -- Layout <-> torch's _layout on real DeviceMesh objects ----------------------------------------


@needs_cute
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_world=64, max_axes=4), st.data())
def test_layout_mesh_layout_matches_device_mesh(layout: Layout, data: st.DataObject) -> None:
    """Random root, a random flatten and a random unflatten of it: the same _layout as torch,
    the same groups, and the same rejection where torch's composition asserts."""
    names = layout.dim_names
    flat_dims = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    flat_dims = sorted(flat_dims, key=names.index)
    split = data.draw(st.sampled_from(_splits(_size(layout, flat_dims))))
    new_names = tuple(f"u{i}" for i in range(len(split)))

    def body() -> list[Any]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", layout.shape, mesh_dim_names=names)
        flat = mesh[tuple(flat_dims)]._flatten("flat")
        seen: list[Any] = [_modes(m._layout) for m in (mesh, mesh[tuple(flat_dims)], flat)]
        try:
            unflat = flat._unflatten(0, split, new_names)
        except Exception as error:
            return [*seen, type(error).__name__]
        groups = [tuple(dist_ranks(unflat, n)) for n in new_names]
        return [*seen, _modes(unflat._layout), tuple(unflat.mesh.flatten().tolist()), groups]

    sample = sorted({0, layout.world_size - 1})
    got = meshsim.run(body, layout.world_size, backend="fake", ranks=sample)
    view = layout[tuple(flat_dims)]
    flattened = view.flatten(name="flat")
    ours = [_modes(m.mesh_layout()) for m in (layout, view, flattened)]
    for rank, theirs in zip(sample, got):
        assert theirs[:3] == ours
        if isinstance(theirs[3], str):
            with pytest.raises(LayoutError) as caught:
                flattened.unflatten("flat", split, new_names)
            assert caught.value.upstream == theirs[3]
            continue
        unflattened = flattened.unflatten("flat", split, new_names)
        assert theirs[3] == _modes(unflattened.mesh_layout())
        assert theirs[4] == unflattened.group_of(rank)
        assert theirs[5] == [unflattened.group_of(rank, n) for n in new_names]
        assert (unflattened.rank_map() == np.arange(layout.world_size)).all()


def dist_ranks(mesh: Any, dim: str) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(mesh.get_group(dim))


@needs_cute
def test_unflatten_across_non_adjacent_axes_is_rejected_like_torch() -> None:
    """torch 2.13 splits a dim by composition, which asserts when a split cuts across the
    axes a flattened dim joined; the grid reshape meshsim used before answered instead."""

    def body() -> str:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 3, 3), mesh_dim_names=("a", "b", "c"))
        try:
            mesh["a", "c"]._flatten("ac")._unflatten(0, (3, 2), ("x", "y"))
        except Exception as error:
            return type(error).__name__
        return "accepted"

    (real,) = meshsim.run(body, 18, backend="fake", ranks=[0])
    flat = Layout(a=2, b=3, c=3)["a", "c"].flatten(name="ac")
    with pytest.raises(LayoutError, match="do not divide") as caught:
        flat.unflatten("ac", (3, 2), ("x", "y"))
    assert real == caught.value.upstream == "AssertionError"
    assert flat.mesh_layout() == MeshLayout([FlatLayout((2, 3), (9, 1))])


def test_explicit_mesh_is_indexed_by_position() -> None:
    layout = Layout.from_mesh([[3, 1], [0, 2]], ("a", "b"))
    assert layout.rank_map().tolist() == [3, 1, 0, 2]
    assert layout.mesh_layout() == MeshLayout.from_sizes_strides((2, 2))
    assert layout.mesh_layout("b").remap_to_tensor(layout.rank_map()).tolist() == [[3, 1], [0, 2]]


@SETTINGS
@given(st.lists(positive_modes, min_size=1, max_size=3))
def test_from_mesh_layout_round_trip(axes: list[list[tuple[int, int]]]) -> None:
    ml = MeshLayout(FlatLayout(*zip(*a)) for a in axes)
    names = tuple(f"d{i}" for i in range(len(ml)))
    if not ml.collapse().check_orthogonal():
        with pytest.raises(LayoutError, match="overlaps"):
            Layout.from_mesh_layout(ml, names)
        return
    layout = Layout.from_mesh_layout(ml, names)
    assert layout.dim_names == names
    assert layout.shape == ml.top_level_sizes
    for i, name in enumerate(names):
        # torch builds the groups of dim i from its layout alone.
        world = layout.world_size
        expected = MeshLayout([ml[i]]).remap_to_tensor(np.arange(world))  # type: ignore[list-item]
        assert sorted(layout.groups(name)) == sorted(map(tuple, expected.tolist()))


def _modes(layout: Any) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    return tuple((tuple(a.shape), tuple(a.stride)) for a in layout)


def _size(layout: Layout, dims: list[str]) -> int:
    return math.prod(layout.size_of(d) for d in dims)


def _splits(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    out += [(d, n // d) for d in range(2, n) if n % d == 0]
    return out


def test_unflatten_of_a_non_contiguous_flatten_keeps_torchs_layout() -> None:
    """Found by hypothesis: the unflattened root axis keeps both modes, as torch's does."""
    flat = meshsim.Layout(pp=2, dp=2, ep=2)["pp", "ep"].flatten(name="flat")
    unflat = flat.unflatten("flat", (4,), ("x",))
    assert unflat.groups("x")[:2] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _modes(unflat.mesh_layout()) == (((2, 2), (4, 1)),)
