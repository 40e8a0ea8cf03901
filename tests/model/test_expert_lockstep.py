"""Expert-parallel peers run in lockstep: the invariant catches planted layouts and holds on
every EP layout of every convention (NVIDIA Model-Optimizer PR 1966)."""

from __future__ import annotations

from collections import Counter

import pytest

import meshsim
from meshsim import Groups, Layout
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.invariants import EXPERT_LOCKSTEP, expert_lockstep_breaks, find_violations

# Every convention with an ``expert`` role.
WITH_EP = (
    "megatron",
    "deepspeed",
    "deepspeed-autoep",
    "torchtitan",
    "olmo-core",
    "transformers",
    "areal-fsdp",
    "areal-archon",
)
EP_STAGE, EP_EDP = (check for check, _ in EXPERT_LOCKSTEP.values())


def _expected(kinds: list[Kind], roles: dict[str, str], world: int = 4) -> Expected:
    return Expected("test", world, {}, kinds, roles)


def _checks(expected: Expected) -> set[str]:
    return {v.check for v in find_violations(expected)}


def test_megatron_ep_layout_keeps_its_expert_peers_in_lockstep() -> None:
    expected = meshsim.expect(
        "megatron",
        8,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    # EP spans TP peers and data-parallel ranks alike: EP is not inside one data-parallel
    # group, which is why the invariant reads the stage and the expert-DP rank instead.
    assert expected.groups("expert") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert expected.groups("data_parallel") == Groups([(0, 2, 4, 6), (1, 3, 5, 7)])
    assert expected.groups("expert_data") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert expert_lockstep_breaks(expected) == {}
    assert find_violations(expected) == []


def test_expert_peers_with_different_expert_dp_ranks_are_caught() -> None:
    layout = Layout(edp=2, ep=2)
    kinds = [
        layout_kind(layout, "ep", "expert parallel", "ep"),
        # The same expert-DP ranks as sets, listed so that rank 1 is expert-DP rank 1: a loader
        # sharded over this group hands EP peers 0 and 1 different shards.
        Kind("edp", "expert data parallel", Groups([(0, 2), (3, 1)])),
    ]
    expected = _expected(kinds, {"expert": "ep", "expert_data": "edp"})
    assert expert_lockstep_breaks(expected) == {"expert_data": Groups([(0, 1), (2, 3)])}
    (violation,) = find_violations(expected)
    assert violation.check == EP_EDP and violation.kind == "ep"
    assert "groups [(0, 1), (2, 3)] hold different expert-data-parallel ranks in edp" in str(
        violation
    )
    assert "all-to-all" in violation.consequence


def test_expert_peers_on_different_pipeline_stages_are_caught() -> None:
    layout = Layout(pp=2, ep=2)
    right = [layout_kind(layout, "pp", "stages", "pp"), layout_kind(layout, "ep", "ep", "ep")]
    assert _checks(_expected(right, {"pipeline": "pp", "expert": "ep"})) == set()
    # EP over the pipeline dim: rank 0 (stage 0) exchanges tokens with rank 2 (stage 1).
    crossed = [layout_kind(layout, "pp", "stages", "pp"), layout_kind(layout, "ep", "ep", "pp")]
    expected = _expected(crossed, {"pipeline": "pp", "expert": "ep"})
    assert expert_lockstep_breaks(expected) == {"pipeline": Groups([(0, 2), (1, 3)])}
    assert EP_STAGE in _checks(expected)


def test_single_rank_or_missing_expert_groups_are_not_checked() -> None:
    layout = Layout(pp=2, dp=2)
    kinds = [
        layout_kind(layout, "pp", "stages", "pp"),
        Kind("ep", "ep = 1", Groups([(r,) for r in range(4)])),
    ]
    assert expert_lockstep_breaks(_expected(kinds, {"pipeline": "pp", "expert": "ep"})) == {}
    assert expert_lockstep_breaks(_expected(kinds[:1], {"pipeline": "pp"})) == {}


@pytest.mark.parametrize("world", [8, 12, 16])
def test_every_convention_keeps_expert_peers_in_lockstep(world: int) -> None:
    checked: Counter[str] = Counter()
    frameworks: set[str] = set()
    for case in meshsim.layouts(world, WITH_EP):
        expected = case.expect()
        if "expert" not in expected.roles or expected.groups("expert").group_size < 2:
            continue
        assert expert_lockstep_breaks(expected) == {}, case.id
        frameworks.add(case.framework)
        for role in EXPERT_LOCKSTEP:
            if role in expected.roles and expected.groups(role).group_size > 1:
                checked[role] += 1
    # Not vacuous: every convention had EP > 1, many with several stages or expert-DP ranks.
    assert frameworks == set(WITH_EP)
    assert checked["pipeline"] > 50 and checked["expert_data"] > 200, checked
