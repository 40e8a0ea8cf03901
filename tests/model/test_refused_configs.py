"""``meshsim.refused_configs``: what each framework rejects, the other half of ``layouts``."""

from __future__ import annotations

import pytest

import meshsim
from meshsim.model import torch_release
from meshsim.model.conventions import CONVENTIONS, convention
from meshsim.model.sweep import RefusedCase

WORLDS = [1, 2, 3, 4, 6, 8, 12, 16]


def test_every_convention_lists_its_refusals() -> None:
    for name in CONVENTIONS:
        assert callable(getattr(convention(name), "refused_configs", None)), name
    assert {case.framework for case in meshsim.refused_configs(8)} == set(CONVENTIONS)


@pytest.mark.parametrize("world", WORLDS)
def test_each_refusal_is_refused_with_the_frameworks_type_and_never_swept(world: int) -> None:
    swept = {(case.framework, repr(case.config)) for case in meshsim.layouts(world)}
    cases = meshsim.refused_configs(world)
    assert len({case.id for case in cases}) == len(cases), "two refusals share an id"
    for case in cases:
        error = case.error()
        assert error.upstream, f"{case.id}: meshsim's own rule, not the framework's: {error}"
        assert (case.framework, repr(case.config)) not in swept, case.id


def test_a_framework_or_several_narrow_the_list() -> None:
    only = meshsim.refused_configs(8, "lightning")
    assert only and {case.framework for case in only} == {"lightning"}
    two = meshsim.refused_configs(8, ["torch", "olmo-core"])
    assert {case.framework for case in two} == {"torch", "olmo-core"}
    assert [c.id for c in two if c.framework == "torch"] == [
        c.id for c in meshsim.refused_configs(8, "torch")
    ]


def test_a_buildable_config_is_not_a_refusal() -> None:
    with pytest.raises(AssertionError, match="the reference builds it"):
        RefusedCase("torch", 8, {"mesh_shape": (2, 4)}).error()


def test_refusals_name_the_upstream_types_of_torch() -> None:
    """Below torch 2.10 there is no ``_unflatten`` to refuse a bad split: not listed there."""
    unflatten = {}
    if torch_release.builds_unflatten():
        unflatten = {"torch-8-shape=8-ops=unflatten:world:2,8>a,b": "ValueError"}
    types = {case.id: case.error().upstream for case in meshsim.refused_configs(8, "torch")}
    assert types == {
        "torch-8-shape=2,8": "RuntimeError",
        "torch-8-shape=1,8-names=dp": "RuntimeError",
        "torch-8-shape=1,8-names=dp,dp": "RuntimeError",
        "torch-8-shape=1,8-names=dp,tp-backend_override={pp:gloo}": "RuntimeError",
        "torch-8-shape=1,8-names=dp,tp-ops=flatten:dp,tp>dp": "ValueError",
        "torch-8-shape=2,4-names=dp,tp-ops=flatten:tp,dp": "KeyError",
        **unflatten,
    }


def test_bad_world_size_is_refused() -> None:
    with pytest.raises(meshsim.LayoutError, match="world_size must be an integer >= 1"):
        meshsim.refused_configs(0)
