"""AReaL 1.0.4's own ``ParallelHelper`` and ``ArchonParallelDims``, on gloo, against the reference.

AReaL 1.0.4 declares torch >= 2.9.1, < 2.11, so these run in a torch 2.10 environment with
areal installed; elsewhere they skip, saying why (``meshsim.builders.real.unavailable``).
"""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import expect, layouts
from meshsim.builders.real import unavailable
from meshsim.errors import LayoutError
from meshsim.model.conventions import areal_archon, areal_fsdp
from tests.real._helpers import (
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    real_outcomes,
)

_WHY = unavailable("areal-fsdp")
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=f"areal is not importable here: {_WHY}"),
    pytest.mark.requires_framework("areal-fsdp"),
]


def strategy(**degrees: int) -> dict[str, int]:
    """An areal-fsdp config from ParallelHelper's short names."""
    long = {
        "dp": "data_parallel_size",
        "sp": "context_parallel_size",
        "tp": "tensor_parallel_size",
        "pp": "pipeline_parallel_size",
        "ep": "expert_parallel_size",
        "etp": "expert_tensor_parallel_size",
    }
    return {long[short]: value for short, value in degrees.items()}


FSDP_4 = [
    strategy(dp=4),
    strategy(dp=2, sp=2),
    strategy(dp=2, tp=2),
    strategy(dp=1, sp=2, tp=2),
    strategy(dp=4, ep=2),
    strategy(dp=2, tp=2, ep=4),  # ETP=1: ep takes tp
    strategy(dp=2, tp=2, ep=2, etp=2),  # ETP=TP: ep from dp only
    strategy(dp=2, sp=2, ep=2),  # ep takes all of sp
]
ARCHON_4 = [
    {},
    {"cp": 2},
    {"pp": 2, "tp": 2},
    {"pp": 2, "cp": 2},
    {"dp_shard": 1, "cp": 2, "tp": 2},
    {"tp": 2, "ep": 2},  # etp=1: ep = dp_shard_in_ep x cp x tp
    {"tp": 2, "ep": 2, "etp": 2},  # the 2-D ep_tp mesh
    {"cp": 2, "ep": 2},  # etp == tp == 1: ep = dp_shard_in_ep x cp
    {"dp_replicate": 2},  # ignored
]


@pytest.mark.parametrize("config", FSDP_4, ids=case_id)
def test_fsdp_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("areal-fsdp", 4, config)


@pytest.mark.parametrize("config", ARCHON_4, ids=case_id)
def test_archon_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("areal-archon", 4, config)


def test_archon_world_8_non_contiguous_pp_cp_tp() -> None:
    """pp_cp_tp skips dp_shard (2): AReaL keeps the mesh _flatten returns."""
    assert_matches("areal-archon", 8, {"pp": 2, "cp": 2})


#: Degrees AReaL never checks, refused by torch (or by Python's %) as the reference says.
UNCHECKED = [
    ("areal-fsdp", strategy(dp=0, tp=4)),  # torch's layout algebra: AssertionError
    ("areal-fsdp", strategy(dp=-1, tp=4)),  # RuntimeError building the mesh tensor
    ("areal-fsdp", strategy(dp=4, pp=0, ep=2)),  # ParallelStrategy: world % 0
    ("areal-fsdp", strategy(dp=4, etp=0, ep=2)),
    ("areal-archon", {"dp_shard": 0}),
    ("areal-archon", {"tp": -1, "cp": -1}),  # product 4: init_device_mesh (2.10 asserts)
    ("areal-archon", {"pp": -1, "dp_shard": -4}),
]


@pytest.mark.parametrize(
    ("framework", "config"),
    [("areal-fsdp", c) for c in areal_fsdp.refused_configs(4)]
    + [("areal-archon", c) for c in areal_archon.refused_configs(4)]
    + UNCHECKED,
    ids=case_id,
)
def test_refusals_match_reference(framework: str, config: dict[str, Any]) -> None:
    assert_refused_alike(framework, 4, config)


def test_fsdp_strategy_smaller_than_world_fails_outside_the_mesh() -> None:
    """ParallelHelper never compares the strategy with the real world: torch builds a 2-rank
    mesh on ranks 0-1 and ranks 2-3 fail (IndexError) slicing it, as the reference says."""
    config = strategy(dp=2)
    with pytest.raises(LayoutError) as reference:
        expect("areal-fsdp", 4, **config)
    outcomes = real_outcomes("areal-fsdp", 4, config, diverging=True)
    assert [o[0] for o in outcomes[2:]] == ["refused", "refused"]
    assert {o[2] for o in outcomes[2:]} == {reference.value.upstream} == {"IndexError"}


@pytest.mark.parametrize(
    ("framework", "config"),
    [("areal-fsdp", strategy(dp=2, tp=2, ep=4)), ("areal-archon", {"tp": 2, "ep": 2, "etp": 2})],
    ids=case_id,
)
def test_build_leaves_environment_unchanged(framework: str, config: dict[str, Any]) -> None:
    assert environment_changes(framework, 4, config) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", layouts(8, "areal-fsdp") + layouts(8, "areal-archon"), ids=case_id)
def test_every_config_matches_reference_world_8(case: Any) -> None:
    assert_matches(case.framework, case.world_size, case.config)
