"""torchtitan convention: current views, intermediate, legacy, hyper_parallel, errors, sweeps."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import _torchtitan_api as api
from meshsim.model.conventions import torchtitan
from meshsim.model.sweep import divisors
from tests.model._tt_olmo_helpers import assert_invariants, assert_same_groups, cases

WORLD = tuple(range(8))
PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7)]
EVEN_ODD = [(0, 2, 4, 6), (1, 3, 5, 7)]


def titan(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("torchtitan", world, **config)


def axes(exp: meshsim.Expected) -> list[str]:
    """The single-axis ``get_mesh`` kinds that answer with a mesh (other kinds: the API's)."""
    return [k for k in exp.kinds() if k in api.AXES]


def off_axes(exp: meshsim.Expected) -> list[str]:
    """Axes the backend registers whose ``get_mesh`` raises "not available" (fake-backed)."""
    return [k for k, e in exp.unavailable().items() if k in api.AXES and "not available" in str(e)]


def unregistered(exp: meshsim.Expected) -> list[str]:
    """Axis names ``get_mesh`` refuses as invalid under this backend."""
    return [
        k for k, e in exp.unavailable().items() if "Invalid mesh dim" in str(e) and k in api.AXES
    ]


def raises(world: int, config: dict[str, Any], upstream: str | None) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        titan(world, **config)
    assert info.value.upstream == upstream
    return info.value


# -- current: the views --------------------------------------------------------------------------
def test_current_spmd_types_kinds_and_roles() -> None:
    exp = titan(8, dp_replicate=2, dp_shard=2, tp=2)
    assert exp.config["spmd_backend"] == "spmd_types"
    assert axes(exp) == ["batch", "loss", "dp_replicate", "tp", "dp", "dp_shard"]
    assert off_axes(exp) == ["pp", "cp", "ep", "efsdp"]
    assert exp.groups("batch") == exp.groups("dp") == exp.groups("loss") == EVEN_ODD
    assert exp.groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("dp_shard") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("tp") == PAIRS
    assert dict(exp.roles) == {
        "data_parallel": "batch",
        "gradient_reduce": "loss",
        "loss": "loss",
        "tensor": "tp",
    }
    assert unregistered(exp) == ["fsdp", "world"]


def test_current_partial_dtensor_has_fsdp_instead_of_dp_and_dp_shard() -> None:
    exp = titan(8, dp_replicate=2, dp_shard=2, tp=2, spmd_backend="partial_dtensor")
    assert axes(exp) == ["batch", "loss", "dp_replicate", "tp", "fsdp"]
    assert exp.groups("fsdp") == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_current_full_dtensor_has_the_dense_storage_view_only() -> None:
    """torchtitan 0.3.0: dense (pp, dp_replicate, dp_shard, cp, tp), no fwd/bwd ``dp`` view,
    no ``fsdp``; sparse (pp, dp_replicate, efsdp, ep) as under the other backends."""
    exp = titan(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4, spmd_backend="full_dtensor")
    assert exp.config["spmd_backend"] == "full_dtensor"
    kinds = ["batch", "loss", "dp_replicate", "cp", "tp", "ep", "efsdp", "dp_shard"]
    assert axes(exp) == kinds
    assert off_axes(exp) == ["pp"]
    assert "dp" not in exp.kinds() and "fsdp" not in exp.kinds()
    spmd = titan(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    for kind in kinds:
        assert exp.groups(kind) == spmd.groups(kind), kind
    assert exp.groups("dp_shard") == [(i, i + 4) for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert dict(exp.roles) == dict(spmd.roles)
    assert exp.layout is not None and exp.layout.root_names == (
        "pp", "dp_replicate", "dp_shard", "cp", "tp"
    )  # fmt: skip


def test_current_full_dtensor_keeps_dp_shard_real_at_size_one() -> None:
    """0.3.0's ``_mesh_exist``: dp_shard exists under full_dtensor and spmd_types at any size."""
    exp = titan(4, tp=4, spmd_backend="full_dtensor")
    assert exp.groups("dp_shard") == [(0,), (1,), (2,), (3,)]
    assert "batch" in off_axes(exp) and "fsdp" in unregistered(exp)
    # the intermediate version's full_dtensor is left as modelled: dp_shard needs degree > 1
    intermediate = titan(4, tp=4, version="intermediate", spmd_backend="full_dtensor")
    assert "dp_shard" in intermediate.unavailable()


def test_current_full_dtensor_get_mesh() -> None:
    config = {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "spmd_backend": "full_dtensor"}
    mesh = torchtitan.get_mesh(8, ["dp_replicate", "dp_shard"], **config)
    assert mesh.shape == (2, 2) and mesh.groups() == EVEN_ODD
    with pytest.raises(LayoutError, match="Invalid mesh dim: 'dp'") as info:
        torchtitan.get_mesh(8, "dp", **config)
    assert info.value.upstream == "ValueError"
    with pytest.raises(LayoutError, match="Invalid mesh dim: 'fsdp'"):
        torchtitan.get_mesh(8, "fsdp", **config)
    # no spmd fwd/bwd views: (dp_replicate, efsdp, ep) comes from the sparse view itself
    sparse = torchtitan.get_mesh(8, ["dp_replicate", "efsdp", "ep"], **{**config, "ep": 2})
    assert sparse.shape == (2, 2, 2)


def test_disabled_axis_is_unavailable_with_get_mesh_error() -> None:
    error = titan(8, dp_shard=8).unavailable()["tp"]
    assert error.upstream == "ValueError"
    assert str(error) == (
        "Mesh 'tp' is not available. Ensure the corresponding parallelism dimension is enabled "
        "(size > 1)."
    )


def test_fsdp_and_spmd_dp_shard_exist_at_size_one() -> None:
    partial = titan(4, tp=4, spmd_backend="partial_dtensor")
    assert partial.groups("fsdp").group_size == 1
    spmd = titan(4, tp=4)
    assert spmd.groups("dp_shard").group_size == 1
    assert "dp" in spmd.unavailable() and "batch" in spmd.unavailable()
    assert "data_parallel" not in spmd.roles


def test_loss_is_batch_times_cp() -> None:
    exp = titan(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, spmd_backend="partial_dtensor")
    assert exp.groups("loss") == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    assert exp.kind("loss").mesh_dims == ("loss_mesh",)
    assert exp.groups("fsdp") == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert exp.groups("batch") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert exp.kind_of("gradient_reduce") == "loss"


def test_ep_groups_equal_tp_groups_when_ep_equals_tp() -> None:
    exp = titan(8, dp_shard=4, tp=2, ep=2)
    assert exp.groups("ep") == exp.groups("tp") == PAIRS
    assert exp.groups("efsdp") == EVEN_ODD
    assert exp.kind_of("expert") == "ep"
    assert exp.kind_of("expert_data") == "efsdp"


def test_ep_takes_tp_then_cp_then_dp_shard() -> None:
    exp = titan(16, dp_shard=4, cp=2, tp=2, ep=8)
    assert exp.groups("ep") == [tuple(range(8)), tuple(range(8, 16))]
    assert exp.groups("efsdp") == [tuple(range(i, 16, 8)) for i in range(8)]
    assert titan(8, dp_shard=2, cp=2, tp=2, ep=4).groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_efsdp_exists_at_size_one_when_ep_is_on() -> None:
    exp = titan(4, dp_shard=4, ep=4)
    assert exp.groups("efsdp").group_size == 1
    assert exp.groups("ep") == [(0, 1, 2, 3)]


def test_pp_is_outermost_in_every_view() -> None:
    exp = titan(8, pp=2, dp_shard=2, tp=2, ep=2)
    assert exp.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("ep") == exp.groups("tp") == PAIRS


# -- get_mesh and get_all_one_dimensional_meshes --------------------------------------------------
def test_get_mesh_multi_axis_comes_from_the_first_view_holding_it() -> None:
    config = {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "spmd_backend": "partial_dtensor"}
    mesh = torchtitan.get_mesh(8, ["dp_replicate", "fsdp"], **config)
    assert mesh.shape == (2, 2)
    assert mesh.dim_names == ("dp_replicate", "fsdp")
    assert mesh.groups() == EVEN_ODD
    assert torchtitan.get_mesh(8, "tp", **config).groups() == PAIRS
    spmd = torchtitan.get_mesh(16, ["dp", "cp"], dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert spmd.dim_names == ("dp", "cp") and spmd.shape == (4, 2)
    sparse = torchtitan.get_mesh(8, ["dp_replicate", "efsdp", "ep"], dp_replicate=2, ep=2, tp=2)
    assert sparse.shape == (2, 2, 2)


@pytest.mark.parametrize(
    ("dims", "config", "message"),
    [
        ("fsdp", {}, "Invalid mesh dim: 'fsdp'. Valid dimensions are: ['pp', 'batch', 'loss', "),
        ("dp_shard", {"spmd_backend": "partial_dtensor"}, "Invalid mesh dim: 'dp_shard'."),
        (
            "cp",
            {},
            "Mesh 'cp' is not available. Ensure the corresponding parallelism dimension "
            "is enabled (size > 1).",
        ),
        (
            ["dp_replicate", "cp"],
            {},
            "Mesh '['dp_replicate', 'cp']' is not available. Ensure the "
            "corresponding parallelism dimension is all enabled.",
        ),
        (
            ["batch", "dp_replicate"],
            {},
            "Invalid mesh name combinations ['batch', 'dp_replicate'].",
        ),
    ],
)
def test_get_mesh_errors(dims: str | list[str], config: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError) as info:
        torchtitan.get_mesh(8, dims, dp_replicate=2, dp_shard=2, tp=2, **config)
    assert str(info.value).startswith(message)
    assert info.value.upstream == "ValueError"


def test_get_mesh_keeps_torch_slicing_rules() -> None:
    with pytest.raises(LayoutError, match="ascending order") as info:
        torchtitan.get_mesh(8, ["tp", "batch"], dp_replicate=2, dp_shard=2, tp=2)
    assert info.value.upstream == "KeyError"


def test_get_mesh_needs_a_multi_view_version() -> None:
    with pytest.raises(LayoutError, match="has one root mesh: slice expect"):
        torchtitan.get_mesh(8, "tp", version="legacy", tp=2)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("spmd_types", {"batch", "loss", "dp_replicate", "tp", "dp", "dp_shard"}),
        ("partial_dtensor", {"batch", "loss", "dp_replicate", "fsdp", "tp"}),
        ("full_dtensor", {"batch", "loss", "dp_replicate", "tp", "dp_shard"}),
    ],
)
def test_one_dimensional_meshes(backend: str, expected: set[str]) -> None:
    meshes = torchtitan.get_all_one_dimensional_meshes(
        8, dp_replicate=2, dp_shard=2, tp=2, spmd_backend=backend
    )
    assert set(meshes) == expected  # efsdp (size 4) is fake-backed with ep == 1
    exp = titan(8, dp_replicate=2, dp_shard=2, tp=2, spmd_backend=backend)
    for axis, groups in meshes.items():
        assert groups == exp.groups(axis)


def test_intermediate_one_dimensional_meshes_keep_fake_axes() -> None:
    meshes = torchtitan.get_all_one_dimensional_meshes(
        8, version="intermediate", dp_replicate=2, dp_shard=2, tp=2
    )
    assert set(meshes) == {"batch", "loss", "dp_replicate", "tp", "efsdp", "fsdp"}
    assert (
        "efsdp" in titan(8, version="intermediate", dp_replicate=2, dp_shard=2, tp=2).unavailable()
    )


# -- intermediate ---------------------------------------------------------------------------------
def test_intermediate_sparse_view_has_etp_innermost() -> None:
    exp = titan(8, version="intermediate", dp_shard=4, tp=2, ep=2, etp=2)
    assert exp.groups("etp") == exp.groups("tp") == PAIRS
    assert exp.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("efsdp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    one = titan(8, version="intermediate", dp_shard=4, tp=2, ep=2, etp=1)
    current = titan(8, dp_shard=4, tp=2, ep=2)
    assert_same_groups(one, current, [("ep", "ep"), ("efsdp", "efsdp")])


def test_intermediate_full_dtensor_exposes_dp_shard() -> None:
    exp = titan(8, version="intermediate", spmd_backend="full_dtensor", dp_replicate=2, dp_shard=4)
    assert exp.groups("dp_shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert "fsdp" not in exp.kinds() and "dp" not in exp.kinds()


# -- legacy ---------------------------------------------------------------------------------------
def test_legacy_flattened_names() -> None:
    exp = titan(16, version="legacy", dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert exp.layout is not None
    assert exp.layout.root_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert exp.layout.aliases == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
    assert exp.groups("dp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert exp.groups("dp_cp") == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    assert dict(exp.roles) == {
        "data_parallel": "dp",
        "gradient_reduce": "dp_cp",
        "loss": "dp_cp",
        "tensor": "tp",
        "context": "cp",
    }
    error = exp.unavailable()["pp"]
    assert error.upstream == "KeyError" and str(error).startswith("Invalid mesh_dim_names ('pp',)")


def test_legacy_ep_with_etp_equal_tp_borrows_cp_and_dp_shard() -> None:
    exp = titan(16, version="legacy", dp_shard=4, cp=2, tp=2, ep=4, etp=2)
    assert exp.layout is not None
    shape = dict(zip(exp.layout.root_names, exp.layout.root_shape))
    assert shape == {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "cp": 2, "tp": 2}
    assert exp.layout.aliases["ep"] == ("dp_shard_in_ep", "cp")
    assert exp.groups("ep") == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert exp.layout.aliases["dp"] == ("dp_shard_mod_ep", "dp_shard_in_ep")
    assert exp.kind_of("expert_data") == "dp_shard_mod_ep"
    assert exp.groups("dp_shard_mod_ep") == [tuple(range(i, 16, 8)) for i in range(8)]


def test_legacy_ep_with_etp_one_borrows_tp_too() -> None:
    exp = titan(8, version="legacy", dp_shard=4, tp=2, ep=4, etp=1)
    assert exp.layout is not None
    shape = dict(zip(exp.layout.root_names, exp.layout.root_shape))
    assert shape == {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "tp": 2}
    assert exp.layout.aliases["ep"] == ("dp_shard_in_ep", "tp")
    assert exp.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("dp") == EVEN_ODD
    # the current innermost-ep sparse view gives the same expert groups
    assert_same_groups(
        exp, titan(8, dp_shard=4, tp=2, ep=4), [("ep", "ep"), ("dp_shard_mod_ep", "efsdp")]
    )


def test_legacy_keeps_dp_shard_mod_ep_at_size_one() -> None:
    exp = titan(4, version="legacy", dp_shard=2, cp=2, ep=4, etp=1)
    assert exp.groups("dp_shard_mod_ep").group_size == 1
    assert exp.groups("ep") == [(0, 1, 2, 3)]
    assert "dp_shard" in exp.unavailable()  # split into dp_shard_mod_ep x dp_shard_in_ep
    assert "ep" in titan(4, version="legacy", dp_shard=4).unavailable()


def test_legacy_world_of_one_has_no_mesh() -> None:
    exp = titan(1, version="legacy")
    assert exp.kinds() == {} and exp.layout is None
    assert str(exp.unavailable()["dp"]).startswith("every degree is 1")


# -- hyper_parallel -------------------------------------------------------------------------------
def test_hyper_parallel_order_and_aliases() -> None:
    exp = titan(8, version="hyper_parallel", dp_replicate=2, ep=2, tp=2, dp_shard=1)
    assert exp.layout is not None
    assert exp.layout.root_names == ("dp_replicate", "ep", "tp")  # pp would be innermost
    assert exp.groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("dp") == exp.groups("loss") == exp.groups("dp_replicate")
    assert "fsdp" in exp.unavailable()  # no dp_shard dim, so no fsdp alias
    with_cp = titan(8, version="hyper_parallel", dp_shard=2, cp=2, tp=2)
    assert with_cp.groups("fsdp") == with_cp.groups("dp_shard") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert with_cp.groups("loss") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert with_cp.kind_of("gradient_reduce") == "loss"


def test_hyper_parallel_dp_shard_infers_with_ep_and_world_of_one() -> None:
    exp = titan(16, version="hyper_parallel", ep=2, tp=2)
    assert exp.config["dp_shard"] == 4
    one = titan(1, version="hyper_parallel")
    assert one.groups("dp_shard") == one.groups("fsdp") == one.groups("loss") == [(0,)]


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["current", "intermediate", "legacy"])
@pytest.mark.parametrize("key", ["dp_replicate", "cp", "tp", "pp", "ep"])
def test_degrees_below_one(version: str, key: str) -> None:
    error = raises(8, {"version": version, key: 0}, "AssertionError")
    assert str(error).startswith("Parallelism degree should be >= 1, except for dp_shard")


def test_etp_below_one_only_where_etp_exists() -> None:
    for version in ("intermediate", "legacy"):
        raises(8, {"version": version, "etp": 0}, "AssertionError")
    assert "no etp" in str(raises(8, {"etp": 2}, None))


@pytest.mark.parametrize("dp_shard", [0, -2])
def test_dp_shard_must_be_minus_one_or_positive(dp_shard: int) -> None:
    assert str(raises(8, {"dp_shard": dp_shard}, "AssertionError")).startswith(
        "dp_shard must -1 or >=1."
    )


def test_dp_shard_inference() -> None:
    assert titan(8, dp_replicate=2, tp=2).config["dp_shard"] == 2
    assert "exceeds the world size 8" in str(raises(8, {"tp": 16}, "AssertionError"))


def test_world_size_mismatch() -> None:
    error = raises(8, {"dp_replicate": 2, "dp_shard": 2}, "AssertionError")
    assert str(error) == (
        "Invalid parallel dims: dp_replicate(2) * dp_shard(2) * cp(1) * tp(1) * pp(1) != "
        "WORLD_SIZE(8)"
    )
    raises(8, {"dp_shard": 3, "version": "legacy"}, "AssertionError")


@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor", "full_dtensor"])
def test_current_ep_must_divide_dp_shard_cp_tp(backend: str) -> None:
    """Both upstream forms are a ValueError: the snapshot's own check, and in torchtitan 0.3.0
    (no check) torch's ``_unflatten`` of the sparse view."""
    config = {"dp_shard": 4, "tp": 2, "ep": 16, "spmd_backend": backend}
    message = str(raises(8, config, "ValueError"))
    assert message.startswith("expert_parallel_degree (16) must divide dp_shard * cp * tp (8). ")
    assert "(pp, dp_replicate, efsdp, ep) = (1, 1, 0, 16)" in message
    assert "The product of mesh_sizes=(1, 1, 0, 16) is 0" in message
    assert "size 8" in message
    three = str(raises(8, {"dp_shard": 8, "ep": 3}, "ValueError"))
    assert "The product of mesh_sizes=(1, 1, 2, 3) is 6" in three
    assert titan(8, pp=2, dp_shard=4, ep=4).groups("ep").group_size == 4  # ep not a world factor


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"dp_shard": 4, "tp": 2, "ep": 2, "etp": 4}, "Currently we only support ETP=TP or ETP=1"),
        (
            {"dp_shard": 2, "cp": 4, "ep": 2, "etp": 1},
            "legacy EP with etp == tp needs ep % cp",
        ),
        ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 8, "etp": 2}, "legacy EP with etp == tp needs"),
        (
            {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2, "etp": 1},
            "legacy EP with etp == 1 needs ep % (cp * tp)",
        ),
    ],
)
def test_legacy_ep_rules(config: dict[str, int], message: str) -> None:
    assert str(raises(8, {"version": "legacy", **config}, "AssertionError")).startswith(message)


def test_intermediate_etp_rule_and_untileable_efsdp() -> None:
    config = {"version": "intermediate", "dp_shard": 4, "tp": 2, "ep": 2, "etp": 4}
    assert str(raises(8, config, "AssertionError")) == "Currently we only support ETP=TP or ETP=1"
    error = raises(8, {"version": "intermediate", "dp_shard": 8, "ep": 16}, "ValueError")
    assert str(error).startswith("The product of sizes=(1, 1, 0, 16, 1) is 0")


@pytest.mark.parametrize(
    ("config", "message", "upstream"),
    [
        ({"cp": 0}, "Parallel degree cp=0 must be >= 1", "ValueError"),
        ({"dp_shard": 0}, "dp_shard=0 must be -1 (auto) or a positive int", "ValueError"),
        (
            {"ep": 3},
            "Cannot auto-infer dp_shard: world_size=8 is not divisible by "
            "dp_replicate*cp*tp*pp*ep=3",
            "ValueError",
        ),
        (
            {"dp_shard": 2, "ep": 2},
            "Invalid parallel dims: dp_replicate(1) * dp_shard(2) * cp(1) "
            "* tp(1) * pp(1) * ep(2) = 4 != world_size(8). Set dp_shard=-1",
            "ValueError",
        ),
        ({"tp": 2, "ep": 2, "etp": 4}, "etp=4 must equal tp=2 or 1", "ValueError"),
        ({"pp": 2}, "Pipeline parallel (pp=2>1) is not yet implemented", "NotImplementedError"),
        ({"cp": 2, "ulysses_degree": 4}, "ulysses_degree=4 must be <= cp=2", "ValueError"),
        (
            {"cp": 4, "ulysses_degree": 3},
            "cp=4 must be divisible by ulysses_degree=3",
            "ValueError",
        ),
    ],
)
def test_hyper_parallel_errors(config: dict[str, int], message: str, upstream: str) -> None:
    assert str(raises(8, {"version": "hyper_parallel", **config}, upstream)).startswith(message)


def test_hyper_parallel_validation_order() -> None:
    # pp > 1 is reported only once every degree checks out; etp first.
    config = {"version": "hyper_parallel", "pp": 2, "tp": 2, "ep": 2, "etp": 4}
    assert str(raises(8, config, "ValueError")).startswith("etp=4")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"version": "v2"}, "unknown torchtitan version 'v2'"),
        (
            {"version": "intermediate", "spmd_backend": "spmd_types"},
            "spmd_backend 'spmd_types' does not exist in torchtitan version 'intermediate'",
        ),
        ({"version": "legacy", "spmd_backend": "spmd_types"}, "spmd_backend 'spmd_types'"),
        ({"ulysses_degree": 2}, "ulysses_degree is an integer option of version='hyper_parallel'"),
        ({"tp": 2.0}, "tp must be an integer degree"),
        ({"dp": 2}, "torchtitan takes no config key(s) ['dp']"),
    ],
)
def test_meshsim_refusals(config: dict[str, Any], message: str) -> None:
    assert str(raises(8, config, None)).startswith(message)


# -- configs() ------------------------------------------------------------------------------------
def test_configs_are_valid_distinct_and_few() -> None:
    configs = list(torchtitan.configs(8))
    assert len(configs) <= 400
    # the degree layouts, then the other backends and dp_shard=-1 over 4 of them (spread)
    assert Counter(c["version"] for c in configs) == {
        "current": 98 + 2 * 4 + 4,
        "intermediate": 110 + 4 + 4,
        "legacy": 92 + 4,
        "hyper_parallel": 40 + 4,
    }
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for config in configs:
        titan(8, **config)


def test_configs_options() -> None:
    current = list(torchtitan.configs(4, versions=["current"]))
    layouts = [c for c in current if "spmd_backend" not in c and c["dp_shard"] != -1]
    inferred = [c for c in current if c["dp_shard"] == -1]
    assert {c.get("spmd_backend") for c in current} == {None, "partial_dtensor", "full_dtensor"}
    both = list(
        torchtitan.configs(4, versions=["current"], spmd_backends=["spmd_types", "partial_dtensor"])
    )
    assert len(both) == 2 * len(layouts) + len(inferred)
    assert {c.get("spmd_backend") for c in both} == {None, "partial_dtensor"}
    assert all(c["version"] == "current" for c in current)
    every = list(torchtitan.configs(4, versions=["current"], spmd_backends=["full_dtensor"]))
    assert len(every) == len(layouts) + len(inferred)
    assert {c["spmd_backend"] for c in every} == {"full_dtensor"}
    for config in every:
        titan(4, **config)
    with pytest.raises(LayoutError, match="unknown torchtitan versions"):
        list(torchtitan.configs(4, versions=["old"]))
    ids = {case.id for case in meshsim.layouts(2, "torchtitan", versions=["legacy"])}
    assert "torchtitan-2-version=legacy-pp=1-dp_replicate=1-dp_shard=2-cp=1-tp=1-ep=2-etp=1" in ids


# -- properties -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(cases("torchtitan"))
def test_invariants_hold_for_every_config(case: tuple[int, dict[str, Any]]) -> None:
    world, config = case
    assert_invariants(titan(world, **config))


@st.composite
def dense_degrees(draw: Any) -> dict[str, int]:
    return {k: draw(st.integers(1, 3)) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}


def _world(d: dict[str, int]) -> int:
    return d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"]


@settings(max_examples=100, deadline=None)
@given(dense_degrees(), st.sampled_from(["spmd_types", "partial_dtensor", "full_dtensor"]))
def test_current_dense_views_equal_legacy(d: dict[str, int], backend: str) -> None:
    current = titan(_world(d), spmd_backend=backend, **d)
    legacy = titan(_world(d), version="legacy", **d)
    pairs = [(k, k) for k in ("pp", "dp_replicate", "cp", "tp")]
    pairs += [("batch", "dp"), ("loss", "dp_cp")]
    pairs += {
        "spmd_types": [("dp", "dp"), ("dp_shard", "dp_shard")],
        "full_dtensor": [("dp_shard", "dp_shard")],
        "partial_dtensor": [("fsdp", "dp_shard_cp")],
    }[backend]
    assert_same_groups(current, legacy, pairs)
    for role in ("data_parallel", "gradient_reduce", "loss", "tensor", "context", "pipeline"):
        assert (role in current.roles) == (role in legacy.roles), role
        if role in current.roles:
            assert current.groups(role) == legacy.groups(role), role


@settings(max_examples=100, deadline=None)
@given(dense_degrees(), st.data())
def test_current_ep_equals_legacy_ep_with_etp_one(d: dict[str, int], data: st.DataObject) -> None:
    region = d["dp_shard"] * d["cp"] * d["tp"]
    borrowed = d["cp"] * d["tp"]
    eps = [e for e in divisors(region) if e > 1 and e % borrowed == 0]
    if not eps:
        return
    ep = data.draw(st.sampled_from(eps))
    current = titan(_world(d), ep=ep, **d)
    legacy = titan(_world(d), version="legacy", ep=ep, etp=1, **d)
    assert_same_groups(
        current, legacy, [("ep", "ep"), ("efsdp", "dp_shard_mod_ep"), ("loss", "dp_cp")]
    )


# -- current: every getter of the 0.3.0 public API ----------------------------------------------
SINGLE_PP = "get_optional_mesh(pp, include_singleton_axes=True)"


def test_singleton_axes_answer_three_ways() -> None:
    """An axis that is off (degree 1, fake-backed): ``get_mesh`` raises, ``get_optional_mesh``
    returns None (no rank holds a group), and with ``include_singleton_axes=True`` every rank
    gets its size-1 mesh. The conventions snapshot (b5bcd76c) has no include_singleton_axes:
    there get_optional_mesh is None for every off axis; torchtitan 0.3.0, which wins, adds it."""
    exp = titan(8, dp_shard=8)
    assert exp.unavailable()["pp"].upstream == "ValueError"
    none = exp.kind("get_optional_mesh(pp)")
    assert none.available and len(none.groups()) == 0 and exp.group_of(3, none.name) is None
    assert exp.groups(SINGLE_PP) == [(r,) for r in WORLD]
    for axis in ("cp", "tp", "ep", "dp_replicate"):
        singles = exp.groups(f"get_optional_mesh({axis}, include_singleton_axes=True)")
        assert singles == [(r,) for r in WORLD], axis
    # efsdp is off without EP although its size is dp_shard * cp * tp = 8
    efsdp = exp.groups("get_optional_mesh(efsdp, include_singleton_axes=True)")
    assert efsdp == [WORLD]
    assert "efsdp" in exp.unavailable() and len(exp.groups("get_optional_mesh(efsdp)")) == 0


def test_get_optional_mesh_function_matches_the_kinds() -> None:
    config = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert torchtitan.get_optional_mesh(8, "pp", **config) is None
    single = torchtitan.get_optional_mesh(8, "pp", include_singleton_axes=True, **config)
    assert single is not None and single.groups() == [(r,) for r in WORLD]
    pair = torchtitan.get_optional_mesh(8, ["dp_replicate", "tp"], **config)
    assert pair is not None and pair.shape == (2, 2)
    assert pair.groups() == titan(8, **config).groups("get_mesh([dp_replicate, tp])")
    assert pair.groups() == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_multi_axis_requests_and_which_raise() -> None:
    """Names first (ValueError), then off axes (None / "not available"), then the first view
    holding them all; torch's KeyError when the order is not the view's."""
    exp = titan(8, dp_replicate=2, dp_shard=2, tp=2)
    assert exp.groups("get_mesh([dp_replicate, dp_shard])") == EVEN_ODD
    assert exp.kind("get_mesh([dp_replicate, dp_shard])").mesh_shape == (2, 2)
    assert "'dense' view" in exp.kinds()["get_mesh([dp_replicate, dp_shard])"]
    assert "'spmd_dense_for_fwdbwd' view" in exp.kinds()["get_mesh([dp, tp])"]
    off = exp.unavailable()["get_mesh([pp, tp])"]
    assert off.upstream == "ValueError" and "all enabled" in str(off)
    assert len(exp.groups("get_optional_mesh([pp, tp])")) == 0
    assert exp.groups("get_optional_mesh([pp, tp], include_singleton_axes=True)") == PAIRS
    reverse = "get_optional_mesh([tp, cp, dp_shard, dp_replicate, pp], include_singleton_axes=True)"
    assert exp.unavailable()[reverse].upstream == "KeyError"
    assert "ascending order" in str(exp.unavailable()[reverse])
    # without singletons the off pp/cp answer None before any slicing
    assert len(exp.groups("get_optional_mesh([tp, cp, dp_shard, dp_replicate, pp])")) == 0
    for request in ("[loss, tp]", "[batch, dp_replicate]"):
        error = exp.unavailable()[f"get_optional_mesh({request}, include_singleton_axes=True)"]
        assert error.upstream == "ValueError" and "Invalid mesh name combinations" in str(error)
    world = exp.unavailable()["get_optional_mesh(world, include_singleton_axes=True)"]
    assert world.upstream == "ValueError" and "Invalid mesh dim: 'world'" in str(world)


def test_reversed_request_over_size_one_dims_is_accepted() -> None:
    """torch drops size-1 dims before checking the order, so reversing a view whose other dims
    are all size 1 slices fine."""
    exp = titan(8, dp_shard=8, ep=2)
    name = "get_optional_mesh([ep, efsdp, dp_replicate, pp], include_singleton_axes=True)"
    assert exp.unavailable()[name].upstream == "KeyError"
    alone = titan(8, dp_shard=8)
    groups = alone.groups(name)
    assert groups == [WORLD]  # only efsdp (size 8) is left: no order to break


def test_world_mesh_and_view_dims() -> None:
    exp = titan(16, pp=2, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    assert exp.groups("world_mesh") == [tuple(range(16))]
    assert exp.groups("dense[pp]") == exp.groups("dataloading[pp]") == exp.groups("pp")
    assert exp.groups("sparse[efsdp]") == exp.groups("efsdp")
    assert exp.groups("spmd_sparse_for_fwdbwd[ep]") == exp.groups("ep")
    assert exp.groups("loss[loss_mesh]") == exp.groups("loss")
    assert exp.unavailable()["dense[fsdp]"].upstream == "KeyError"  # spmd_types: no fsdp dim
    partial = titan(16, pp=2, dp_replicate=2, dp_shard=2, tp=2, spmd_backend="partial_dtensor")
    assert partial.groups("dense[fsdp]") == partial.groups("fsdp")
    assert partial.unavailable()["spmd_dense_for_fwdbwd[dp]"].upstream == "KeyError"


def test_spmd_sparse_view_exists_only_with_ep() -> None:
    """0.3.0 adds a (dp_replicate, efsdp, ep) fwd/bwd view under spmd_types when ep > 1; the
    conventions snapshot lists no such view (the released code wins)."""
    with_ep = titan(8, dp_shard=4, tp=2, ep=2)
    assert with_ep.groups("spmd_sparse_mesh()") == [(0, 1, 2, 3, 4, 5, 6, 7)]
    assert with_ep.kind("spmd_sparse_mesh()").mesh_shape == (1, 4, 2)
    without = titan(8, dp_shard=4, tp=2)
    assert len(without.groups("spmd_sparse_mesh()")) == 0  # None, not an error
    assert without.unavailable()["spmd_sparse_for_fwdbwd[ep]"].upstream == "KeyError"


def test_spmd_meshes_keep_enabled_axes_only() -> None:
    exp = titan(16, pp=2, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    dense = exp.kind("spmd_meshes()[0]")
    assert dense.mesh_dims == ("dp", "tp") and dense.mesh_shape == (4, 2)
    sparse = exp.kind("spmd_meshes()[1]")
    assert sparse.mesh_dims == ("dp_replicate", "efsdp", "ep")
    assert exp.groups("spmd_meshes()[1][ep]") == exp.groups("ep")
    assert exp.unavailable()["spmd_meshes()[0][cp]"].upstream == "KeyError"  # cp is off
    one = titan(8, dp_shard=4, tp=2)
    assert one.unavailable()["spmd_meshes()[1]"].upstream == "IndexError"
    full = titan(8, dp_shard=8, spmd_backend="full_dtensor")
    assert full.kind("spmd_meshes()[0]").mesh_dims == ("dp_shard",)
    assert titan(8, pp=8).unavailable()["spmd_meshes()[0]"].upstream == "IndexError"


def test_dense_tp_mesh_per_backend() -> None:
    """spmd_types: tp of the fwd/bwd view, fake at size 1; full_dtensor: tp of the first SPMD
    mesh, KeyError when tp is off; partial_dtensor: get_mesh('tp'), ValueError when off."""
    assert titan(8, dp_shard=8).groups("get_dense_tp_mesh()") == [(r,) for r in WORLD]
    full = titan(8, dp_shard=8, spmd_backend="full_dtensor")
    assert full.unavailable()["get_dense_tp_mesh()"].upstream == "KeyError"
    partial = titan(8, dp_shard=8, spmd_backend="partial_dtensor")
    assert partial.unavailable()["get_dense_tp_mesh()"].upstream == "ValueError"
    for backend in ("spmd_types", "full_dtensor", "partial_dtensor"):
        exp = titan(8, dp_shard=4, tp=2, spmd_backend=backend)
        assert exp.groups("get_dense_tp_mesh()") == PAIRS, backend


def test_every_kind_has_a_one_line_description() -> None:
    for backend in ("spmd_types", "full_dtensor", "partial_dtensor"):
        exp = titan(16, pp=2, dp_replicate=2, cp=2, tp=2, ep=2, spmd_backend=backend)
        every = {**exp.kinds(), **{n: exp.kind(n).description for n in exp.unavailable()}}
        assert len(every) > 150
        assert all(text and "\n" not in text for text in every.values())


def test_unknown_spmd_backend_is_parallelism_configs_value_error() -> None:
    """0.3.0 validates spmd_backend in ParallelismConfig (ValueError); the snapshot is silent."""
    assert raises(8, {"spmd_backend": "dtensor"}, "ValueError")
    assert raises(8, {"version": "intermediate", "spmd_backend": "spmd_types"}, None)


@pytest.mark.parametrize("world", [8, 16])
def test_refused_configs_are_all_refused(world: int) -> None:
    refused = api.refused_configs(world)
    kinds = Counter()
    for config in refused:
        kinds[raises(world, config, raises_upstream(world, config)).upstream] += 1
    assert set(kinds) == {"ValueError", "AssertionError"}


def raises_upstream(world: int, config: dict[str, Any]) -> str:
    with pytest.raises(LayoutError) as info:
        titan(world, **config)
    assert info.value.upstream in ("ValueError", "AssertionError"), config
    return info.value.upstream
