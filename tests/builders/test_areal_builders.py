"""AReaL builders vs the reference: fake (every rank), threaded and gloo, refusals alike."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.model.conventions import areal_archon, areal_fsdp
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.builders._ranks import build_every_rank, on_rank

_LONG = {
    "dp": "data_parallel_size",
    "sp": "context_parallel_size",
    "tp": "tensor_parallel_size",
    "ep": "expert_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def strategy(**degrees: int) -> dict[str, int]:
    """An areal-fsdp config from ParallelHelper's short names (dp, sp, tp, ep, etp)."""
    return {_LONG[short]: value for short, value in degrees.items()}


CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("areal-fsdp", 8, strategy(dp=2, sp=2, tp=2)),
    ("areal-fsdp", 8, strategy(dp=4, tp=2, ep=4)),
    ("areal-fsdp", 8, strategy(dp=2, sp=2, tp=2, ep=2, etp=2)),
    ("areal-fsdp", 4, strategy(dp=4)),
    ("areal-archon", 8, {}),
    ("areal-archon", 8, {"pp": 2, "cp": 2, "tp": 2}),
    ("areal-archon", 8, {"pp": 2, "cp": 2}),  # pp_cp_tp skips dp_shard: a non-contiguous flatten
    ("areal-archon", 8, {"tp": 2, "ep": 4}),
    ("areal-archon", 8, {"cp": 2, "tp": 2, "ep": 2, "etp": 2}),
    ("areal-archon", 8, {"tp": 2, "ep": 2, "etp": 2}),  # cp 1: ep is dp_shard_in_ep alone
]
IDS = [f"{fw}-{w}-" + ",".join(f"{k}={v}" for k, v in c.items()) for fw, w, c in CASES]


@pytest.mark.parametrize(("framework", "world", "config"), CASES, ids=IDS)
def test_builder_matches_reference_on_every_fake_rank(
    framework: str, world: int, config: dict[str, Any]
) -> None:
    expected = meshsim.expect(framework, world, **config)
    observed = build_every_rank(framework, world, config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert set(expected.kinds()) <= seen


def test_archon_ep_tp_is_a_2d_mesh() -> None:
    obs = on_rank("areal-archon", 8, {"cp": 2, "tp": 2, "ep": 2, "etp": 2}, rank=5)
    assert obs.groups["ep_tp"].mesh == [[4, 5], [6, 7]]
    assert obs.groups["ep"].members == (5, 7)


REFUSED = [("areal-fsdp", c) for c in areal_fsdp.refused_configs(8)] + [
    ("areal-archon", c) for c in areal_archon.refused_configs(8)
]


@pytest.mark.parametrize(("framework", "config"), REFUSED, ids=str)
def test_builder_refuses_what_the_reference_refuses(framework: str, config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect(framework, 8, **config)
    with pytest.raises((RuntimeError, ValueError)) as built:
        on_rank(framework, 8, config, rank=0)
    assert getattr(built.value, "upstream", None) == reference.value.upstream


def test_fsdp_strategy_smaller_than_the_world_is_refused_with_index_error() -> None:
    config = {"data_parallel_size": 2}
    with pytest.raises(LayoutError) as reference:
        meshsim.expect("areal-fsdp", 4, **config)
    with pytest.raises(RuntimeError) as built:
        on_rank("areal-fsdp", 4, config, rank=3)
    assert getattr(built.value, "upstream", None) == reference.value.upstream == "IndexError"


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_communicating_tiers(backend: str) -> None:
    cases = [
        LayoutCase("areal-fsdp", 4, strategy(dp=2, tp=2, ep=2, etp=2)),
        LayoutCase("areal-archon", 4, {"pp": 2, "tp": 2, "ep": 2}),
        LayoutCase("areal-archon", 4, {"tp": 2, "ep": 2, "etp": 2}),
    ]  # fmt: skip
    results = list(verify_many(cases, backend, timeout=120))
    for result in results:
        assert result.passed and result.rejected is None, str(result)
    assert "ep" in results[1].kinds_checked and "ep_tp" in results[2].kinds_checked
