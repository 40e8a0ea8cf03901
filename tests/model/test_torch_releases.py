"""What the reference says for a torch release without ``DeviceMesh._unflatten`` (< 2.10)."""

from __future__ import annotations

import pytest

from meshsim import Layout, LayoutError, expect
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


def test_2_10_and_2_11_refuse_a_dim_by_name_later_releases_take_it(monkeypatch):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.10")
    with pytest.raises(LayoutError, match="specified in `_unflatten` is not in") as e:
        expect("torch", 8, ops=["unflatten world 2,4 -> dp,tp"])
    assert e.value.upstream == "ValueError"
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.11")
    with pytest.raises(LayoutError, match="specified in `_unflatten` is not in"):
        expect("torch", 8, ops=["unflatten world 2,4 -> dp,tp"])
    for release in ("2.12", "newest"):
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


@pytest.mark.parametrize(
    ("release", "accepted"), [("2.9", False), ("2.10", False), ("2.12", False), ("2.13", True)]
)
def test_slicing_past_size_one_dims_out_of_order(monkeypatch, release, accepted):
    # 2.13 compares collapsed layouts (size-1 dims vanish); 2.10-2.12 compare every dim's
    # stride, and earlier releases the root dim indices.
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
    layout = Layout(pp=1, batch=1, cp=8, tp=1)
    if accepted:
        assert layout["tp", "cp", "batch", "pp"].world_size == 8
    else:
        with pytest.raises(LayoutError, match="ascending order") as e:
            layout["tp", "cp", "batch", "pp"]
        assert e.value.upstream == "KeyError"


@pytest.mark.parametrize("release", ["2.10", "2.12"])
def test_a_non_contiguous_flattened_dim_cannot_be_sliced_on_2_10_to_2_12(monkeypatch, release):
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
    root = Layout(a=2, b=2, c=2)["a", "c"].flatten(name="ac").root()
    with pytest.raises(LayoutError, match="contiguous flattened dim") as e:
        root["ac"]
    assert e.value.upstream == "NotImplementedError"
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.13")
    assert root["ac"].group_of(0, "ac") == (0, 1, 4, 5)


def test_torchtitan_sweeps_only_what_the_release_builds(monkeypatch):
    from meshsim import layouts

    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "2.9")
    old = layouts(8, "torchtitan")
    assert {c.config["version"] for c in old} == {"legacy", "hyper_parallel"}
    for case in old:  # every enumerated case is one the release builds
        expect("torchtitan", 8, **case.config)
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", "newest")
    assert len(layouts(8, "torchtitan")) == 368


@pytest.mark.parametrize(
    ("release", "upstream"),
    [("2.9", "RuntimeError"), ("2.10", "AssertionError"), ("2.12", "AssertionError"),
     ("2.13", "RuntimeError"), ("newest", "RuntimeError")],
)  # fmt: skip
def test_negative_mesh_sizes_assert_on_2_10_to_2_12(monkeypatch, release, upstream):
    """Two negative sizes multiplying to the world pass Lightning's and AReaL Archon's checks;
    init_device_mesh then raises what the release raises (measured: 2.9.1, 2.10.0, 2.13.0,
    2.15.0)."""
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
    for framework, config in (
        ("lightning", {"data_parallel_size": -2, "tensor_parallel_size": -4}),
        ("areal-archon", {"tp": -1, "cp": -1}),
    ):
        with pytest.raises(LayoutError) as refused:
            expect(framework, 8, **config)
        assert refused.value.upstream == upstream, framework
