"""Lightning builder against the reference: every layout on the fake tier, a sample on threaded
and gloo, the refusals, and a wrong reference that must be caught."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.model.conventions import lightning
from meshsim.verify import verify
from tests.builders._ranks import build_every_rank, on_rank

LAYOUTS = meshsim.layouts(8, "lightning") + meshsim.layouts(6, "lightning")


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
def test_builder_matches_reference_on_every_rank(case: meshsim.LayoutCase) -> None:
    observed = build_every_rank("lightning", case.world_size, case.config)
    assert diff(observed, case.expect()) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert seen == set(case.expect().kinds())


@pytest.mark.parametrize("config", list(lightning.refused_configs(8)), ids=str)
def test_builder_refuses_with_lightnings_exception_type(config: dict[str, Any]) -> None:
    with pytest.raises(meshsim.LayoutError) as reference:
        meshsim.expect("lightning", 8, **config)
    # RuntimeError, but torch 2.10-2.12's init_device_mesh asserts on negative sizes.
    with pytest.raises((RuntimeError, AssertionError)) as built:
        on_rank("lightning", 8, config, rank=0)
    upstream = getattr(built.value, "upstream", None) or type(built.value).__name__
    assert upstream == reference.value.upstream


def test_a_transposed_mesh_is_caught() -> None:
    observed = build_every_rank(
        "lightning", 8, {"data_parallel_size": 2, "tensor_parallel_size": 4}
    )
    wrong = meshsim.expect("lightning", 8, data_parallel_size=4, tensor_parallel_size=2)
    found = diff(observed, wrong)
    assert found is not None
    assert set(found.kinds()) == {"data_parallel", "tensor_parallel"}


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_live_tiers_prove_the_groups(backend: str) -> None:
    result = verify("lightning", 4, backend, num_nodes=2, timeout=300)
    assert result.passed, result
