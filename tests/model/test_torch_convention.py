"""The "torch" convention: init_device_mesh + flatten/unflatten ops, kinds, roles, sweeps."""

from __future__ import annotations

import subprocess
import sys

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.invariants import find_violations
from meshsim.model.sweep import ordered_factorizations


def test_dims_flattened_names_and_roles() -> None:
    expected = meshsim.expect(
        "torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"), ops=["flatten dp,cp"]
    )
    assert list(expected.kinds()) == ["dp", "cp", "tp", "dp_cp"]
    assert expected.groups("dp_cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert expected.roles["gradient_reduce"] == "dp_cp"
    assert expected.roles["data_parallel"] == "dp"
    assert expected.group_of(5, "tensor") == (4, 5)
    assert expected.local_rank(5, "gradient_reduce") == 2


def test_tuple_ops_and_explicit_name() -> None:
    a = meshsim.expect(
        "torch",
        8,
        mesh_shape=(2, 4),
        mesh_dim_names=("dp", "tp"),
        ops=[("flatten", ("dp", "tp"), "all")],
    )
    assert a.groups("all") == [tuple(range(8))]


def test_unflatten_views_like_torchtitan() -> None:
    expected = meshsim.expect(
        "torch",
        16,
        ops=[
            "unflatten world 2,4,2 -> pp,batch,tp",
            "unflatten world 2,2,2,2 -> pp,dp_replicate,fsdp,tp",
        ],
    )
    assert expected.groups("batch") == [
        (0, 2, 4, 6),
        (1, 3, 5, 7),
        (8, 10, 12, 14),
        (9, 11, 13, 15),
    ]
    assert expected.groups("fsdp") == [
        (0, 2),
        (1, 3),
        (4, 6),
        (5, 7),
        (8, 10),
        (9, 11),
        (12, 14),
        (13, 15),
    ]


def test_explicit_mesh() -> None:
    expected = meshsim.expect("torch", 4, mesh=[[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
    assert expected.groups("a") == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mesh_shape": (2, 2), "mesh_dim_names": ("a",)}, "should have same length"),
        ({"mesh_shape": (4, 4)}, "Mesh should not be bigger than default world size 8"),
        ({"mesh_shape": (2, 2)}, "covers 4 ranks, not the world size 8"),
        ({"mesh_shape": (2, 4), "mesh_dim_names": ("a", "a")}, "unique"),
        (
            {"mesh_shape": (2, 4), "mesh_dim_names": ("a", "b"), "ops": ["flatten b,a"]},
            "ascending order",
        ),
        (
            {"mesh_shape": (2, 4), "mesh_dim_names": ("a", "b"), "ops": ["squash a"]},
            "cannot parse op",
        ),
        (
            {"mesh_shape": (2, 4), "mesh_dim_names": ("a", "b"), "ops": ["flatten a,c"]},
            "no mesh view holds",
        ),
        (
            {"mesh_shape": (2, 4), "mesh_dim_names": ("a", "b"), "ops": ["flatten a,b -> b"]},
            "already exists",
        ),
        ({"mesh_shape": (8,), "roles": {"tensor": "nope"}}, "unknown kind 'nope'"),
        ({"mesh_shape": (8,), "roles": {"tensr": "world"}}, "unknown role 'tensr'"),
        ({"mesh_shapes": (8,)}, "takes no config key\\(s\\) \\['mesh_shapes'\\]"),
    ],
)
def test_errors(config: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(LayoutError, match=message):
        meshsim.expect("torch", 8, **config)


def test_unknown_framework_and_bad_world() -> None:
    with pytest.raises(
        LayoutError, match="unknown framework 'jax'; known frameworks: torch, olmo-core"
    ):
        meshsim.expect("jax", 8)
    with pytest.raises(LayoutError, match="world_size must be an integer >= 1, got 0"):
        meshsim.expect("torch", 0)
    with pytest.raises(LayoutError, match="no group kind or role 'nope'"):
        meshsim.expect("torch", 8).groups("nope")
    with pytest.raises(LayoutError, match="outside world size 8"):
        meshsim.expect("torch", 8).group_of(8, "world")


def test_sweep_every_factorization_and_invariants() -> None:
    cases = meshsim.layouts(8, "torch")
    assert len(cases) == len(list(ordered_factorizations(8, 4))) == 20
    assert len({c.id for c in cases}) == len(cases)
    for case in cases:
        expected = case.expect()
        assert find_violations(expected) == [], case.id


def test_reference_imports_without_torch() -> None:
    code = (
        "import sys, meshsim; "
        "meshsim.expect('torch', 8, mesh_shape=(2, 4), mesh_dim_names=('dp', 'tp')).groups('tp'); "
        "[meshsim.expect(c.framework, c.world_size, **c.config) for c in meshsim.layouts(4)]; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
