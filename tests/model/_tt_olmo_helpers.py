"""Shared checks for the OLMo-core and torchtitan convention tests: invariants and strategies."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from hypothesis import strategies as st

import meshsim
from meshsim.model.conventions import convention
from meshsim.model.invariants import validate_invariants

#: World sizes the property tests sample: a mix of prime powers and products of 2 and 3.
WORLDS = (1, 2, 3, 4, 6, 8, 12, 16, 18, 24, 32)


@cache
def _configs(framework: str, world_size: int) -> tuple[dict[str, Any], ...]:
    return tuple(convention(framework).configs(world_size))


@st.composite
def cases(draw: Callable[..., Any], framework: str) -> tuple[int, dict[str, Any]]:
    """A world size and one of the framework's valid configs for it."""
    world = draw(st.sampled_from(WORLDS))
    return world, draw(st.sampled_from(_configs(framework, world)))


def groups_as_sets(exp: meshsim.Expected, kind: str) -> list[frozenset[int]]:
    return [frozenset(g) for g in exp.groups(kind)]


def assert_contained(exp: meshsim.Expected, inner: str, outer: str) -> None:
    """Every group of ``inner`` lies inside one group of ``outer``."""
    outer_groups = groups_as_sets(exp, outer)
    for group in groups_as_sets(exp, inner):
        assert any(group <= o for o in outer_groups), (inner, sorted(group), outer)


def assert_invariants(exp: meshsim.Expected) -> None:
    """meshsim's invariants (partitions, gradient_reduce ⊇ data_parallel, peers sharing their
    data-parallel rank, pipeline neighbours) plus the flattening ones these conventions add."""
    validate_invariants(exp)
    for name in exp.kinds():
        kind = exp.kind(name)
        if kind.mesh_shape:
            assert kind.groups().group_size == math.prod(kind.mesh_shape), (name, kind.mesh_shape)
    layout = exp.layout
    if layout is not None:
        # A flattened name spans the product of the dims it flattens, row-major.
        for alias, axes in layout.aliases.items():
            assert layout.groups(alias) == layout.groups(*axes), alias
            assert layout.size_of(alias) == math.prod(layout.size_of(a) for a in axes), alias
    roles = exp.roles
    for role in ("context", "data_parallel"):
        if role in roles and "loss" in roles:
            assert_contained(exp, role, "loss")
    for left, right in (("tensor", "data_parallel"), ("context", "data_parallel")):
        if left in roles and right in roles:
            # Orthogonal axes meet in at most one rank.
            right_groups = groups_as_sets(exp, right)
            for group in groups_as_sets(exp, left):
                assert all(len(group & g) <= 1 for g in right_groups), (left, right)


def assert_same_groups(
    left: meshsim.Expected, right: meshsim.Expected, pairs: Iterable[tuple[str, str]]
) -> None:
    """Kinds named differently by two conventions hold the same groups.

    Where one side does not create its kind (a degree-1 dim torchtitan leaves out), the other
    side's groups must be singletons.
    """
    for a, b in pairs:
        ka, kb = left.kind(a), right.kind(b)
        if ka.available and kb.available:
            assert ka.groups() == kb.groups(), (a, b, ka.groups(), kb.groups())
        elif ka.available:
            assert ka.groups().group_size == 1, (a, "vs unavailable", b)
        elif kb.available:
            assert kb.groups().group_size == 1, (b, "vs unavailable", a)
