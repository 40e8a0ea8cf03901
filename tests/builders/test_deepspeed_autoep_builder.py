"""The AutoEP folding builder against the reference (fake, threaded, gloo) and against DeepSpeed's
own ``local_folding_ranks``; a wrong group must be caught."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from meshsim import LayoutCase
from meshsim.checks import Observation
from meshsim.model.conventions import deepspeed_autoep
from meshsim.verify import verify, verify_many
from tests.builders import _wrong
from tests.builders._ranks import build_every_rank, on_rank

FW = "deepspeed-autoep"
SAMPLE: list[dict[str, Any]] = [
    {"tp_size": 2, "ep_size": 4},
    {"tp_size": 4, "ep_size": 2},  # cross-lane EP
    {"pp_size": 2, "ep_size": 2},
    {"tp_size": 2, "ep_size": 1},  # refused
]


def test_every_config_and_refusal_of_world_8_and_16_on_the_fake_tier() -> None:
    cases = [
        LayoutCase(FW, world, config)
        for world in (8, 16)
        for config in (*deepspeed_autoep.configs(world), *deepspeed_autoep.refused_configs(world))
    ]
    results = list(verify_many(cases, "fake"))
    assert len(results) == len(cases) == 19 + 10 + 31 + 10
    failed = [str(r) for r in results if not r.passed]
    assert not failed, failed


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
@pytest.mark.parametrize("config", SAMPLE, ids=str)
def test_sample_on_communicating_tiers(backend: str, config: dict[str, Any]) -> None:
    result = verify(FW, 8, backend, timeout=120, **config)
    assert result.passed, str(result)


def test_rank_5_hand_checked() -> None:
    obs = on_rank(FW, 8, {"tp_size": 2, "ep_size": 4}, 5)
    members = {name: view.members for name, view in obs.groups.items()}
    assert members == {"tp": (4, 5), "dense_dp": (1, 3, 5, 7), "ep": (4, 5, 6, 7), "edp": (1, 5)}


def test_tp_1_records_no_tp_group() -> None:
    obs = on_rank(FW, 8, {"pp_size": 2, "ep_size": 2}, 6)
    assert "tp" in obs.absent and obs.groups["edp"].members == (4, 6)


def _swapped(world_size: int, config: Mapping[str, Any]) -> Observation:
    """The folding builder, but handing out the dense data-parallel group as the EDP group."""
    from meshsim.builders.deepspeed_autoep import build

    obs = build(world_size, config)
    return replace(obs, groups={**obs.groups, "edp": obs.groups["dense_dp"]})


def test_a_builder_handing_out_the_wrong_edp_group_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshsim.verify as verify_module

    monkeypatch.setattr(verify_module, "BUILDERS", {FW: "tests.builders._wrong"})
    monkeypatch.setattr(_wrong, "BEHAVIOUR", _swapped)
    assert verify(FW, 8, "fake", tp_size=2, ep_size=2).passed  # edp == dense_dp there
    result = verify(FW, 8, "fake", tp_size=4, ep_size=2)
    assert not result.passed and "edp" in str(result)


@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("world", [8, 16])
def test_every_rank_equals_local_folding_ranks(world: int) -> None:
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    for config in deepspeed_autoep.configs(world):
        spec = folding.build_folding_spec(world_size=world, **config)
        for obs in build_every_rank(FW, world, config):
            local = folding.local_folding_ranks(obs.rank, spec)
            for kind in ("dense_dp", "ep", "edp"):
                assert obs.groups[kind].members == local[kind], (config, obs.rank, kind)
            if config["tp_size"] > 1:
                assert obs.groups["tp"].members == local["tp"]
