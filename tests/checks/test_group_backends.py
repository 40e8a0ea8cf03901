"""A group's backend is part of the layout: a real axis left ``fake`` is a diff naming the kind.

The bugs planted here live in small rank bodies, not in a framework's files: ``tp`` built with
``backend_override={"tp": "fake"}`` where the program expects a real tp group (its collectives
would silently do nothing), and megatron's gloo twin of ``dp`` built on another backend than
gloo. Before backends were observed both passed: the member lists are right.
"""

from __future__ import annotations

import pytest

import meshsim
from meshsim.checks import diff, observe, observe_groups

TIERS = ["threaded", "gloo"]
SHAPE = {"mesh_shape": (2, 2), "mesh_dim_names": ("dp", "tp")}


def _tp_made_fake() -> meshsim.Observation:
    from torch.distributed.device_mesh import init_device_mesh

    from meshsim.builders.real._shims import register_fake_backend

    register_fake_backend()
    mesh = init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": "fake"}
    )
    return observe(mesh)


@pytest.mark.parametrize("backend", TIERS)
def test_a_real_axis_made_fake_is_a_backend_diff(backend: str) -> None:
    observations = meshsim.run(_tp_made_fake, 4, backend=backend, timeout=120)
    for obs in observations:
        assert obs.groups["tp"].backends == ("fake",)
        assert obs.groups["tp"].gathered is None  # a fake group cannot prove itself
        assert obs.groups["dp"].backends == (backend,)
    found = diff(observations, meshsim.expect("torch", 4, **SHAPE))
    assert found is not None
    assert found.kinds() == ["tp"]
    assert [m.aspect for m in found.mismatches] == ["backend"]
    assert str(found).splitlines()[1].strip() == (
        f"tp: ranks 0-3: backend fake; expected {backend} (the world's backend)"
    )


@pytest.mark.parametrize("backend", TIERS)
def test_the_fake_axis_the_reference_asks_for_passes(backend: str) -> None:
    """The same program against a reference that says tp is fake (as torchtitan's size-1 axes
    are): nothing to report."""
    observations = meshsim.run(_tp_made_fake, 4, backend=backend, timeout=120)
    expected = meshsim.expect("torch", 4, **SHAPE, backend_override={"tp": "fake"})
    assert diff(observations, expected) is None


def _megatron_groups(twin_backend: str | None) -> meshsim.Observation:
    """megatron-core's dp, tp and dp:gloo for tp 2 at world 4, the twin on ``twin_backend``."""
    import torch.distributed as dist

    from meshsim.builders.real._shims import register_fake_backend

    register_fake_backend()
    me = dist.get_rank()
    held = {}
    for kind, families, backend in (
        ("dp", [[0, 2], [1, 3]], None),
        ("tp", [[0, 1], [2, 3]], None),
        ("dp:gloo", [[0, 2], [1, 3]], twin_backend),
    ):
        for ranks in families:
            group = dist.new_group(ranks, backend=backend)
            if me in ranks:
                held[kind] = group
    return observe_groups(held)


@pytest.mark.parametrize("backend", TIERS)
def test_a_gloo_twin_on_the_wrong_backend_is_a_diff(backend: str) -> None:
    expected = meshsim.expect("megatron", 4, tensor_model_parallel_size=2)
    right = meshsim.run(_megatron_groups, 4, backend=backend, timeout=120, args=("gloo",))
    assert diff(right, expected) is None
    wrong = meshsim.run(_megatron_groups, 4, backend=backend, timeout=120, args=("fake",))
    found = diff(wrong, expected)
    assert found is not None and found.kinds() == ["dp:gloo"]
    assert "dp:gloo: ranks 0-3: backend fake; expected gloo" in str(found)


def test_a_twin_on_the_default_backend_is_caught_where_the_default_is_not_gloo() -> None:
    """On the threaded tier the world's backend is ``threaded``, so a twin built without
    ``backend="gloo"`` differs; on the gloo tier the two are the same backend, as on a real
    gloo-only cluster (the nccl tier tells them apart where GPUs exist)."""
    expected = meshsim.expect("megatron", 4, tensor_model_parallel_size=2)
    threaded = meshsim.run(_megatron_groups, 4, backend="threaded", timeout=120, args=(None,))
    found = diff(threaded, expected)
    assert found is not None
    assert "dp:gloo: ranks 0-3: backend threaded; expected gloo" in str(found)
    gloo = meshsim.run(_megatron_groups, 4, backend="gloo", timeout=120, args=(None,))
    assert diff(gloo, expected) is None


def test_backends_are_not_compared_on_the_fake_tier() -> None:
    """Every group of a fake world is fake, whatever was asked: the check cannot be made."""
    observations = meshsim.run(_tp_made_fake, 4, backend="fake", timeout=120)
    assert all(o.groups["tp"].backends == ("fake",) for o in observations)
    assert diff(observations, meshsim.expect("torch", 4, **SHAPE)) is None
