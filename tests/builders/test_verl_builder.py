"""verl builder against the reference: every layout on the fake tier, a sample on threaded and
gloo, the refusals, and wrong references that must be caught (verl#7493, dispatch)."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.model.conventions import verl
from meshsim.verify import verify
from tests.builders._ranks import build_every_rank, on_rank

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")

LAYOUTS = meshsim.layouts(8, "verl")
SLOW_LAYOUTS = meshsim.layouts(6, "verl") + meshsim.layouts(16, "verl")


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
def test_builder_matches_reference_on_every_rank(case: meshsim.LayoutCase) -> None:
    expected = case.expect()
    observed = build_every_rank("verl", case.world_size, case.config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert seen == set(expected.kinds()) | set(expected.unavailable())


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_LAYOUTS, ids=str)
def test_builder_matches_reference_at_other_world_sizes(case: meshsim.LayoutCase) -> None:
    observed = build_every_rank("verl", case.world_size, case.config)
    assert diff(observed, case.expect()) is None


@pytest.mark.parametrize("config", list(verl.refused_configs(8)), ids=str)
def test_builder_refuses_with_verls_exception_type(config: dict[str, Any]) -> None:
    with pytest.raises(meshsim.LayoutError) as reference:
        meshsim.expect("verl", 8, **config)
    with pytest.raises((RuntimeError, AssertionError, ValueError)) as built:
        on_rank("verl", 8, config, rank=0)
    upstream = getattr(built.value, "upstream", None) or type(built.value).__name__
    assert upstream == reference.value.upstream


def test_fsdp1_gradient_group_is_not_fsdp2s() -> None:
    observed = build_every_rank("verl", 4, {"fsdp_size": 1})
    assert observed[2].groups["fsdp_reduce"].members == (2,)
    found = diff(observed, meshsim.expect("verl", 4, fsdp_size=1, strategy="fsdp2"))
    assert found is not None and found.kinds() == ["fsdp_reduce"]


def test_dispatch_without_ulysses_is_caught_against_a_ulysses_reference() -> None:
    observed = build_every_rank("verl", 4, {})
    found = diff(observed, meshsim.expect("verl", 4, ulysses_sequence_parallel_size=2))
    assert found is not None
    assert {"dispatch", "collect", "get_data_parallel_group"} <= set(found.kinds())


@pytest.mark.parametrize(
    ("backend", "config"),
    [
        ("threaded", {"fsdp_size": 2, "ulysses_sequence_parallel_size": 2}),
        ("gloo", {"strategy": "fsdp2", "fsdp_size": 1, "ulysses_sequence_parallel_size": 2}),
        (
            "gloo",
            {"strategy": "torchtitan", "data_parallel_shard_size": 2, "tensor_parallel_size": 2},
        ),
    ],
    ids=str,
)
def test_live_tiers_prove_the_groups(backend: str, config: dict[str, Any]) -> None:
    result = verify("verl", 4, backend, timeout=300, **config)
    assert result.passed, result
