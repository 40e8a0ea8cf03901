"""torchtitan's own ``ParallelDims.build_mesh`` / ``get_mesh`` on gloo, against the reference."""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import expect, layouts
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.harness import run
from meshsim.model.conventions._torchtitan_api import refused_configs
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.real._helpers import (
    TIMEOUT,
    assert_matches,
    assert_refused_alike,
    case_id,
    environment_changes,
    real_outcomes,
    require,
)

pytestmark = [require("torchtitan", "torchtitan"), pytest.mark.requires_framework("torchtitan")]

WORLD_4: list[dict[str, Any]] = [
    {},
    {"dp_shard": 2, "tp": 2},
    {"dp_replicate": 2, "dp_shard": 2},
    {"dp_shard": 2, "cp": 2},
    {"pp": 2, "dp_shard": 2},
    {"dp_shard": 4, "ep": 2},
    {"dp_shard": 2, "tp": 2, "ep": 4},
    {"dp_replicate": 4},  # dp_shard=-1 resolves to 1
    {"dp_replicate": 2, "cp": 2, "spmd_backend": "partial_dtensor"},
    {"dp_shard": 2, "tp": 2, "ep": 2, "spmd_backend": "partial_dtensor"},
    {"tp": 4, "spmd_backend": "full_dtensor"},  # dp_shard stays real at size 1
    {"dp_replicate": 2, "dp_shard": 2, "spmd_backend": "full_dtensor"},
    {"dp_shard": 2, "tp": 2, "ep": 4, "spmd_backend": "full_dtensor"},
]
WORLD_8: list[dict[str, Any]] = [
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
    {"dp_shard": 4, "tp": 2, "ep": 2},
    {"pp": 2, "dp_shard": 2, "cp": 2, "ep": 4},
    {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "ep": 2},
    {"dp_replicate": 2, "cp": 2, "tp": 2, "spmd_backend": "partial_dtensor"},
    {"dp_shard": 4, "tp": 2, "spmd_backend": "full_dtensor"},
    {"pp": 2, "dp_replicate": 2, "cp": 2, "ep": 2, "spmd_backend": "full_dtensor"},
]
REFUSED: list[tuple[int, dict[str, Any]]] = [
    (4, {"tp": 3}),  # world != product
    (4, {"dp_shard": 0}),
    (4, {"tp": 0}),
    (8, {"dp_shard": 8, "ep": 3}),  # ep does not divide dp_shard*cp*tp
    (8, {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 8}),
    (8, {"dp_shard": 4, "tp": 2, "ep": 3, "spmd_backend": "full_dtensor"}),
    (4, {"dp_shard": -2}),
    (4, {"tp": 8}),  # dp_shard=-1 resolves to 0
    (4, {"dp_shard": 2, "spmd_backend": "dtensor"}),  # ParallelismConfig's ValueError
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("torchtitan", 4, config)


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("torchtitan", 8, config)


def test_ep_is_the_innermost_sparse_axis() -> None:
    """The convention's worked example, on torchtitan itself: dp_shard 4 x tp 2, ep 2."""
    observations = assert_matches("torchtitan", 8, {"dp_shard": 4, "tp": 2, "ep": 2})
    assert [o.groups["ep"].members for o in observations[:4]] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(o.groups["ep"].members == o.groups["tp"].members for o in observations)


@pytest.mark.parametrize(("world", "config"), REFUSED, ids=case_id)
def test_refusals_match_reference(world: int, config: dict[str, Any]) -> None:
    assert_refused_alike("torchtitan", world, config)


def test_ep_divisibility_is_caught_by_torch_unflatten() -> None:
    """torchtitan 0.3.0 has no explicit EP check: torch's ``_unflatten`` of the sparse view
    refuses efsdp x ep != world with a ValueError, the type the reference names; the reference's
    message gives both the rule and torch's words."""
    message = assert_refused_alike("torchtitan", 8, {"dp_shard": 8, "ep": 3})
    assert "The product of mesh_sizes=(1, 1, 2, 3) is 6" in message
    with pytest.raises(LayoutError) as reference:
        expect("torchtitan", 8, dp_shard=8, ep=3)
    assert "must divide dp_shard * cp * tp (8)" in str(reference.value)
    assert "The product of mesh_sizes=(1, 1, 2, 3) is 6" in str(reference.value)


def test_full_dtensor_views_match_the_reference() -> None:
    """torchtitan 0.3.0's ``spmd_backend="full_dtensor"``: dense (pp, dp_replicate, dp_shard, cp,
    tp), ``dp_shard`` always real, no ``dp`` / ``fsdp``; the reference's current version agrees."""
    config = {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "spmd_backend": "full_dtensor"}
    observations = assert_matches("torchtitan", 8, config)
    for obs in observations:  # get_mesh("dp") / ("fsdp") raise: no such axis under full_dtensor
        assert "dp_shard" in obs.groups and {"dp", "fsdp"} <= set(obs.absent)
    assert expect("torchtitan", 8, **config).unavailable()["fsdp"].upstream == "ValueError"
    assert observations[0].groups["dp_shard"].members == (0, 2)


def _one_dimensional_meshes(world: int, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """torchtitan's own ``get_all_one_dimensional_meshes``: axis -> this rank's group."""
    import torch.distributed as dist

    from meshsim.builders.real import _shims, torchtitan

    _shims.register_fake_backend()
    dims = torchtitan.parallel_dims(world, config)
    with _shims.unchanged_environ(), _shims.torchtitan_device(_shims.device_type()):
        dims.build_mesh()
        meshes = dims.get_all_one_dimensional_meshes()
    return {axis: tuple(dist.get_process_group_ranks(m.get_group())) for axis, m in meshes.items()}


@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor", "full_dtensor"])
@pytest.mark.parametrize(
    "config", [{"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"tp": 4, "ep": 2}]
)
def test_one_dimensional_meshes_match_reference(backend: str, config: dict[str, Any]) -> None:
    """``get_all_one_dimensional_meshes`` (axes of size > 1 that are not fake-backed)."""
    from meshsim.model.conventions import torchtitan

    full = {**config, "spmd_backend": backend}
    world = 8 if "dp_replicate" in config else 4
    observed = run(
        _one_dimensional_meshes, world, backend="gloo", timeout=TIMEOUT, args=(world, full)
    )
    reference = torchtitan.get_all_one_dimensional_meshes(world, **full)
    assert set(observed[0]) == set(reference)
    for rank, meshes in enumerate(observed):
        for axis, members in meshes.items():
            assert reference[axis].group_of(rank) == members, (rank, axis)


def test_other_versions_are_refused_with_a_usage_error() -> None:
    outcomes = real_outcomes("torchtitan", 4, {"version": "legacy", "dp_shard": 4})
    assert {o[1] for o in outcomes} == {"UsageError"}
    assert "version='legacy'" in outcomes[0][3]


def _device_type_after_build() -> tuple[str, str]:
    from meshsim.builders.real import torchtitan

    torchtitan.build(4, {"dp_shard": 2, "tp": 2})
    from torchtitan.distributed import parallel_dims
    from torchtitan.tools import utils

    return parallel_dims.device_type, utils.device_type


def test_device_type_shim_is_restored() -> None:
    """The build runs on "cpu" (a "cuda" mesh would fail on this GPU-less gloo world), and
    torchtitan's module attribute is back to torchtitan's own choice afterwards."""
    after, own = run(_device_type_after_build, 4, backend="gloo", timeout=TIMEOUT)[0]
    assert after == own


def test_build_leaves_environment_unchanged() -> None:
    """Keeps harness workers warm: a worker whose environment changed is replaced."""
    assert environment_changes("torchtitan", 4, {"dp_shard": 2, "tp": 2}) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        case
        for world in (4, 8)
        for case in layouts(
            world,
            "torchtitan",
            versions=["current"],
            spmd_backends=["spmd_types", "partial_dtensor", "full_dtensor"],
        )
    ],
    ids=case_id,
)
def test_every_config_matches_reference(case: Any) -> None:
    assert_matches("torchtitan", case.world_size, case.config)


# -- every getter of the 0.3.0 public API ---------------------------------------------------------
ANSWERED: list[tuple[int, dict[str, Any]]] = [
    (4, {"dp_shard": 2, "tp": 2}),
    (4, {"dp_shard": 2, "tp": 2, "ep": 4, "spmd_backend": "full_dtensor"}),
    (4, {"dp_replicate": 2, "cp": 2, "spmd_backend": "partial_dtensor"}),
    (8, {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "ep": 2}),
    (8, {"pp": 8}),  # every dense axis off: spmd_meshes() is empty
]


def _answers(world: int, config: dict[str, Any]) -> dict[str, str]:
    """On a rank: each getter's answer from torchtitan itself: "mesh", "None" or the type of
    the exception it raised."""
    from torch.distributed.device_mesh import DeviceMesh

    from meshsim.builders import _torchtitan_api as titan_api
    from meshsim.builders.real import _shims, torchtitan

    _shims.register_fake_backend()
    dims = torchtitan.parallel_dims(world, config)
    with _shims.unchanged_environ(), _shims.torchtitan_device(_shims.device_type()):
        dims.build_mesh()
        entries = titan_api.entries(dims)
    return {
        name: "mesh" if isinstance(e, DeviceMesh) else "None" if e is None else type(e).__name__
        for name, e in entries.items()
    }


def _reference_answers(world: int, config: dict[str, Any]) -> dict[str, str]:
    exp = expect("torchtitan", world, **config)
    answers = {name: "mesh" if len(exp.groups(name)) else "None" for name in exp.kinds()}
    answers.update({n: str(e.upstream) for n, e in exp.unavailable().items()})
    return answers


@pytest.mark.parametrize(("world", "config"), ANSWERED, ids=case_id)
def test_every_getter_answers_as_the_reference_says(world: int, config: dict[str, Any]) -> None:
    """Which calls return a mesh, which return None and which raise (and with which exception
    type), call by call: the same ~230 names on both sides, none missing, none extra."""
    per_rank = run(_answers, world, backend="gloo", timeout=TIMEOUT, args=(world, config))
    assert all(answers == per_rank[0] for answers in per_rank)
    assert per_rank[0] == _reference_answers(world, config)
    assert len(per_rank[0]) > 150


def test_fake_backed_meshes_are_observed_unproven() -> None:
    """torchtitan backs off axes with the fake backend, which cannot communicate: the adapter
    records their ranks from the mesh and proves every real group by an all-gather."""
    observations = assert_matches("torchtitan", 4, {"dp_shard": 2, "tp": 2})
    for obs in observations:
        pp = obs.groups["get_optional_mesh(pp, include_singleton_axes=True)"]
        assert pp.members == (obs.rank,) and pp.gathered is None
        assert obs.groups["tp"].gathered == obs.groups["tp"].members
        assert "pp" in obs.absent and "get_optional_mesh(pp)" in obs.absent


def test_a_wrong_reference_is_caught_on_singleton_and_view_kinds() -> None:
    """torchtitan built dp_shard=4; a reference for dp_replicate=4 agrees on batch and loss but
    not on the fake-backed dp_replicate / dp_shard meshes nor the dense view's dims."""
    observations = assert_matches("torchtitan", 4, {"dp_shard": 4})
    found = diff(observations, expect("torchtitan", 4, dp_replicate=4))
    assert found is not None
    wrong = {m.kind for m in found.mismatches}
    assert "batch" not in wrong and "loss" not in wrong
    assert {
        "get_optional_mesh(dp_replicate, include_singleton_axes=True)",
        "dense[dp_replicate]",
        "dense[dp_shard]",
    } <= wrong


def _case(world: int, config: dict[str, Any]) -> LayoutCase:
    return LayoutCase("torchtitan", world, {"version": "current", **config})


BACKENDS = ["spmd_types", "partial_dtensor", "full_dtensor"]


@pytest.mark.slow
def test_every_world_16_layout_matches_on_the_fake_backend() -> None:
    """World 16 on gloo is heavy for a 2-core machine: torchtitan's own ParallelDims builds on
    the fake backend too (no proofs there); every layout and every refusal is compared."""
    cases = layouts(16, "torchtitan", versions=["current"], spmd_backends=BACKENDS)
    refused = [_case(16, c) for c in refused_configs(16)]
    results = list(verify_many([*cases, *refused], "fake", real=True, timeout=600))
    failed = [str(r) for r in results if not r.passed]
    assert not failed, failed[:3]
    assert sum(bool(r.rejected) for r in results) == len(refused)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_every_refused_config_is_refused_alike(world: int) -> None:
    for config in refused_configs(world):
        assert_refused_alike("torchtitan", world, config)
