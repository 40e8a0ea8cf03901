"""transformers builder vs the reference: fake (every rank), threaded and gloo, refusals alike."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.harness import run
from meshsim.model import torch_release
from meshsim.model.conventions._transformers_configs import refused_configs
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.builders._ranks import build_every_rank, on_rank

CASES: list[tuple[int, dict[str, Any]]] = [
    (8, {"fsdp_size": 4, "tp_size": 2, "ep_size": 4}),
    (8, {"dp_replicate_size": 2, "fsdp_size": 2, "tp_size": 2, "ep_size": 4}),
    (8, {"pp_size": 2, "tp_size": 4}),  # the Trainer's accelerate mesh is refused
    (8, {"fsdp_size": 8, "ep_size": 8}),  # no trainer mesh (tp 1); efsdp 1
    (8, {"tp_plan": "auto", "fsdp_size": 2}),  # tp derived: 4
    (8, {"tp_size": 8, "enable_expert_parallel": True}),
    (8, {}),  # nothing distributed: no mesh at all
    (4, {"dp_replicate_size": 2, "fsdp_size": 2}),
]
IDS = [f"{w}-" + ",".join(f"{k}={v}" for k, v in c.items()) for w, c in CASES]


@pytest.mark.parametrize(("world", "config"), CASES, ids=IDS)
def test_builder_matches_reference_on_every_fake_rank(world: int, config: dict[str, Any]) -> None:
    expected = meshsim.expect("transformers", world, **config)
    observed = build_every_rank("transformers", world, config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert set(expected.kinds()) | set(expected.unavailable()) <= seen


def test_builder_slices_hsdp_and_expert_meshes_as_transformers_does() -> None:
    obs = on_rank("transformers", 8, {"dp_replicate_size": 2, "fsdp_size": 2, "tp_size": 2,
                                      "ep_size": 4}, rank=5)  # fmt: skip
    assert obs.groups["fsdp_mesh"].mesh == [[1, 3], [5, 7]]  # (dp_replicate, fsdp), 2-D
    assert obs.groups["expert:ep"].members == (4, 5, 6, 7)
    assert obs.groups["expert:fsdp_mesh"].mesh == [[1], [5]]  # (dp_replicate, efsdp=1)
    assert obs.groups["trainer:tp"].members == obs.groups["tp"].members == (4, 5)


@pytest.mark.parametrize("config", list(refused_configs(8)), ids=str)
def test_builder_refuses_what_the_reference_refuses(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect("transformers", 8, **config)
    with pytest.raises((RuntimeError, ValueError)) as built:
        on_rank("transformers", 8, config, rank=0)
    assert getattr(built.value, "upstream", None) == reference.value.upstream


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_communicating_tiers(backend: str) -> None:
    cases = [
        LayoutCase("transformers", 4, {"fsdp_size": 2, "tp_size": 2, "ep_size": 4}),
        LayoutCase("transformers", 4, {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2}),
        LayoutCase("transformers", 4, {"pp_size": 2, "tp_size": 2}),
    ]
    results = list(verify_many(cases, backend, timeout=120))
    for result in results:
        assert result.passed and result.rejected is None, str(result)
        assert "expert:ep" in result.kinds_checked
    assert "trainer:tp" in results[0].kinds_checked


def _job_meshes(config: dict[str, Any]) -> tuple[list[str], set[str]]:
    """On a rank: the names of the job's meshes and which pairs share a communicator."""
    from meshsim.builders.transformers import meshes
    from meshsim.checks.agreement import check_meshes

    built = meshes(4, config)
    shared = check_meshes(built, independent=True)
    return list(built), {d.subject for d in shared if d.aspect == "shared communicator"}


def test_whole_world_dims_of_all_three_meshes_are_one_communicator() -> None:
    # tp over the whole world: torch >= 2.10 hands every whole-world dim the default group, so
    # the model's tp, the expert mesh's efsdp (ep 1) and the Trainer's tp are one
    # communicator. Before 2.10 only a 1-D mesh's dim gets it (the Trainer's ("tp",)): the
    # 4-D meshes make groups of their own, and nothing is shared.
    whole_world_shared = (torch_release.installed() or (2, 10)) >= (2, 10)
    for names, shared in run(_job_meshes, 4, backend="gloo", timeout=120, args=({"tp_size": 4},)):
        assert names == ["main", "expert", "trainer"]
        if whole_world_shared:
            assert {"main:tp = trainer:tp", "main:tp = expert:efsdp"} <= shared
        else:
            assert not shared
    for names, shared in run(
        _job_meshes, 4, backend="gloo", timeout=120, args=({"fsdp_size": 2, "tp_size": 2},)
    ):
        assert names == ["main", "expert", "trainer"] and not shared
