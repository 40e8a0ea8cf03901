"""AReaL grid builder vs the reference: fake (every rank), threaded and gloo, refusals alike, and
one group object per member set across the models of a job, live."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.harness import run
from meshsim.model.conventions import areal
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.builders._ranks import build_every_rank, on_rank

CONFIGS = list(areal.configs(8, unordered=True))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: LayoutCase("areal", 8, c).id)
def test_builder_matches_reference_on_every_fake_rank(config: dict[str, Any]) -> None:
    expected = meshsim.expect("areal", 8, **config)
    observed = build_every_rank("areal", 8, config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert seen == set(expected.kinds()) == set(areal.KINDS)


def test_builder_hands_out_no_group_where_the_grid_misplaces_a_rank() -> None:
    config = {"num_dp": 2, "num_tp": 2, "rank_mapping": [0, 2, 1, 3]}
    lost = on_rank("areal", 4, config, rank=1)
    assert "dp_proc_group" in lost.absent and "slice_proc_group" in lost.absent
    assert lost.groups["tp_dp_proc_group"].members == (0, 1, 2, 3)
    kept = on_rank("areal", 4, config, rank=0)
    assert kept.groups["dp_proc_group"].members == (0, 1)


@pytest.mark.parametrize("config", list(areal.refused_configs(8)), ids=str)
def test_builder_refuses_what_the_reference_refuses(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect("areal", 8, **config)
    with pytest.raises((RuntimeError, ValueError, KeyError)) as built:
        on_rank("areal", 8, config, rank=0)
    raised = getattr(built.value, "upstream", None) or type(built.value).__name__
    assert raised == reference.value.upstream


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_communicating_tiers(backend: str) -> None:
    cases = [
        LayoutCase("areal", 8, {"num_pp": 2, "num_dp": 2, "num_tp": 2}),
        LayoutCase("areal", 8, {"num_pp": 2, "num_tp": 2, "rank_mapping": [4, 5, 6, 7]}),
        LayoutCase(
            "areal",
            8,
            {
                "num_dp": 2,
                "num_tp": 2,
                "topology": "data_pipe_tensor",
                "rank_mapping": [1, 3, 5, 7],
            },
        ),
    ]
    for result in verify_many(cases, backend, timeout=120):
        assert result.passed and result.rejected is None, str(result)
        assert set(result.kinds_checked) == set(areal.KINDS)


def test_gloo_members_of_a_misplaced_group_disagree_about_it() -> None:
    # Live, ranks 0 and 3 hold data-parallel groups whose other member holds none: a collective
    # over them would wait forever, so meshsim reports the disagreement instead of proving it.
    config = {"num_dp": 2, "num_tp": 2, "rank_mapping": [0, 2, 1, 3]}
    (result,) = verify_many([LayoutCase("areal", 4, config)], "gloo", timeout=120)
    assert result.diff is not None
    assert {m.aspect for m in result.diff.mismatches} == {"disagreement"}
    exp = meshsim.expect("areal", 4, **config)
    shared = {b.kind for b in areal.order_breaks(4, **config) if exp.groups(b.kind).group_size > 1}
    # The singleton groups lost (pipe, embedding) have no other member to disagree.
    assert shared == {
        f"{k}_proc_group{t}" for k in ("ds_model", "dp", "slice") for t in ("", "_gloo")
    }
    assert set(result.diff.kinds()) == shared
    assert result.diff.ranks_affected() == (0, 3)


MODELS: list[dict[str, Any]] = [
    {"num_pp": 2, "num_dp": 2, "num_tp": 2},  # actor: every rank
    {"num_dp": 4, "rank_mapping": [4, 5, 6, 7]},  # critic
    {"num_dp": 2, "num_tp": 2, "topology": "data_pipe_tensor", "rank_mapping": [4, 5, 6, 7]},
]


def _one_objects(world: int, configs: list[dict[str, Any]]) -> tuple[str, list, set]:
    """On a rank: build every model's grid; the (model, kind) pairs it holds and which of them
    are one object."""
    import torch.distributed as dist

    from meshsim.builders.areal import build_grids

    held = {}
    for model, entries in enumerate(build_grids(world, configs)):
        for kind, entry in entries.items():
            if kind != "p2p_groups" and entry is not None and dist.get_rank(entry) >= 0:
                held[(model, kind)] = entry
    same = {(a, b) for a, b in combinations(sorted(held), 2) if held[a] is held[b]}
    return str(dist.get_backend()), sorted(held), same


@pytest.mark.parametrize("backend", ["fake", "threaded", "gloo"])
def test_models_over_the_same_ranks_share_one_group_object(backend: str) -> None:
    results = run(_one_objects, 8, backend, timeout=120, args=(8, MODELS))
    models = areal.expect_models(8, MODELS)
    world_backend = results[0][0]
    shared = areal.shared_groups(8, MODELS, backend=world_backend)
    across_models = 0
    for rank, (_, held, same) in enumerate(results):
        want_held = sorted(
            (m, k)
            for m, exp in enumerate(models)
            for k in areal.KINDS
            if k != "p2p_groups" and exp.group_of(rank, k) is not None
        )
        assert [h for h in held if h[1] != "process_group"] == want_held
        want_same = {
            (a, b)
            for s in shared
            if rank in s.ranks
            for a, b in combinations(sorted(s.users), 2)
            if a in held and b in held
        }
        assert same == want_same, rank
        across_models += sum(a[0] != b[0] for a, b in same)
    assert across_models > 0  # the critic and the reference share groups with the actor
    twins = ((0, "dp_proc_group"), (0, "dp_proc_group_gloo"))
    assert (twins in results[0][2]) == (world_backend == "gloo")
