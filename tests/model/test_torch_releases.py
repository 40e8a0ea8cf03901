"""What the reference says for a torch release without ``DeviceMesh._unflatten`` (< 2.10)."""

from __future__ import annotations

import pytest

from meshsim import LayoutError, expect
from meshsim.model import torch_release as _torch_release


@pytest.mark.parametrize("release", ["2.6", "2.9"])
def test_unflatten_op_raises_attribute_error_before_2_10(monkeypatch, release):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
    with pytest.raises(LayoutError, match=rf"torch {release} has no DeviceMesh._unflatten") as e:
        expect("torch", 8, ops=["unflatten world 2,4 -> dp,tp"])
    assert e.value.upstream == "AttributeError"
    # flatten exists on every release: the same mesh without the unflatten is modelled
    expected = expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    assert tuple(expected.groups("tp")[0]) == (0, 1, 2, 3)


@pytest.mark.parametrize("version", ["current", "intermediate"])
def test_torchtitan_versions_that_unflatten_raise_on_2_9_and_legacy_does_not(monkeypatch, version):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.9")
    with pytest.raises(LayoutError, match=r"has no DeviceMesh\._unflatten"):
        expect("torchtitan", 8, dp_shard=4, tp=2, version=version)
    legacy = expect("torchtitan", 8, dp_shard=4, tp=2, version="legacy")
    assert tuple(legacy.groups("tp")[0]) == (0, 1)


def test_2_10_refuses_a_dim_by_name_later_releases_take_it(monkeypatch):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.10")
    with pytest.raises(LayoutError, match="specified in `_unflatten` is not in") as e:
        expect("torch", 8, ops=["unflatten world 2,4 -> dp,tp"])
    assert e.value.upstream == "ValueError"
    for release in ("2.11", "newest"):
        monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
        expected = expect("torch", 8, ops=["unflatten world 2,4 -> dp,tp"])
        assert tuple(expected.groups("tp")[1]) == (4, 5, 6, 7)


def test_a_malformed_pin_is_refused(monkeypatch):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "two.nine")
    with pytest.raises(LayoutError, match="MESHSIM_TORCH_RELEASE"):
        _torch_release.target()


def test_without_a_pin_the_installed_release_is_described(monkeypatch):
    monkeypatch.delenv("MESHSIM_TORCH_RELEASE")
    torch = pytest.importorskip("torch")
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert _torch_release.target() == (major, minor)
