"""The torch convention's roles come from the dim names by family, never from a guess.

Issue 28: an HSDP mesh ``(dp_replicate, dp_shard, tp)`` once got ``data_parallel =
gradient_reduce = dp_shard``, so correct code failed the data check ("ranks 0 and 4 are
model-parallel peers") and the gradient check passed on groups of one rank. The live cases run
one threaded world each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshsim
from meshsim import DataflowMismatch, LayoutError, NothingCompared, RolesUnknown, record_batches

HSDP = ("dp_replicate", "dp_shard", "tp")
#: The issue's mesh at world 8: dp_shard is 1, so the data and gradient groups are (0, 4), ...
ISSUE = meshsim.expect("torch", 8, mesh_shape=(2, 1, 4), mesh_dim_names=HSDP)
UNNAMED = meshsim.expect("torch", 8, mesh_shape=(2, 1, 4))
NO_DATA_PARALLEL = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("pp", "tp"))


def test_hsdp_names_give_the_replicate_times_shard_product() -> None:
    exp = meshsim.expect("torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=HSDP)
    assert exp.roles["data_parallel"] == exp.roles["gradient_reduce"] == "dp_replicate×dp_shard"
    assert exp.groups("data_parallel") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.unknown_roles == {}
    with_cp = meshsim.expect(
        "torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp")
    )
    assert with_cp.groups("data_parallel") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert with_cp.groups("gradient_reduce") == [tuple(range(8))]  # FSDP reduces over cp too
    flattened = meshsim.expect(
        "torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=HSDP,
        ops=["flatten dp_replicate,dp_shard -> dp"],
    )  # fmt: skip
    assert flattened.roles["data_parallel"] == "dp"  # the user's own flatten is the kind
    assert ISSUE.roles["data_parallel"] == ISSUE.roles["gradient_reduce"] == "dp_replicate"
    assert ISSUE.groups("gradient_reduce") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_a_product_kind_is_derived_so_verify_neither_expects_nor_skips_it() -> None:
    """The product kind is no process group: verify checks the mesh's own kinds and reports
    no gap, while the role's groups stay usable by name."""
    from meshsim.verify import verify

    config = {"mesh_shape": (2, 2, 2), "mesh_dim_names": HSDP}
    exp = meshsim.expect("torch", 8, **config)
    product = "dp_replicate×dp_shard"
    assert list(exp.derived_kinds()) == [product] and product in exp.kinds()
    assert exp.kind(product).derived and not exp.kind("dp_shard").derived
    assert ISSUE.derived_kinds() == {}  # dp_shard is 1: the role is the mesh's dp_replicate
    result = verify("torch", 8, "threaded", **config)
    assert result.passed, str(result)
    assert result.skipped == {}
    assert set(result.kinds_checked) == {"dp_replicate", "dp_shard", "tp", "get_local_rank"}


@pytest.mark.parametrize("loss", [True, False], ids=["loss-flattened", "no-loss"])
def test_torchtitan_names_reduce_over_dp_replicate_and_fsdp(loss: bool) -> None:
    # torchtitan's partial_dtensor views: fsdp is dp_shard x cp, so it is no data dim here.
    # The root's dim by index, as torchtitan passes it (torch 2.10 and 2.11 refuse a name).
    ops = [
        "unflatten 0 2,2,2 -> batch,cp,tp",
        *(["flatten batch,cp -> loss"] if loss else []),
        "unflatten 0 2,2,2 -> dp_replicate,fsdp,tp",
    ]
    exp = meshsim.expect("torch", 8, ops=ops)
    assert exp.roles["data_parallel"] == "batch"
    assert exp.groups("data_parallel") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.roles["gradient_reduce"] == ("loss" if loss else "batch×cp")
    assert exp.groups("gradient_reduce") == [(0, 2, 4, 6), (1, 3, 5, 7)]  # not fsdp's (0, 2)


def test_names_outside_every_family_leave_the_roles_unknown() -> None:
    assert set(UNNAMED.unknown_roles) == {"data_parallel", "gradient_reduce", "loss"}
    message = UNNAMED.unknown_roles["data_parallel"]
    assert "'dim0', 'dim2' fit no naming family" in message  # dim1 has size 1
    assert "roles={'data_parallel': ..., 'gradient_reduce': ...}" in message
    assert "\n" not in message
    with pytest.raises(LayoutError, match="cannot tell the gradient_reduce role"):
        UNNAMED.groups("gradient_reduce")
    records = [record_batches([[r]], rank=r) for r in range(8)]
    with pytest.raises(RolesUnknown, match=r"pass roles=\{'data_parallel'"):
        meshsim.assert_data_parallel(records, UNNAMED)
    given = meshsim.expect(
        "torch", 8, mesh_shape=(2, 1, 4),
        roles={"data_parallel": "dim0,dim1", "gradient_reduce": "dim0"},
    )  # fmt: skip
    assert given.unknown_roles == {}
    assert given.roles["data_parallel"] == "dim0×dim1"
    assert given.groups("data_parallel") == ISSUE.groups("data_parallel")
    expert = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "ep"))
    assert "'ep' is an expert dim" in expert.unknown_roles["data_parallel"]


def test_roles_may_say_there_is_none() -> None:
    exp = meshsim.expect("torch", 8, mesh_shape=(8,), roles={"data_parallel": None})
    assert "data_parallel" not in exp.roles and "data_parallel" not in exp.unknown_roles
    assert "gradient_reduce" in exp.unknown_roles
    with pytest.raises(LayoutError, match="no mesh view holds together"):
        meshsim.expect("torch", 8, mesh_shape=(2, 4), roles={"data_parallel": "dim0,dp"})


def _issue_step() -> dict[str, Any]:
    """The issue's correct HSDP code, three samplers' records and three references' verdicts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler

    mesh = init_device_mesh("cpu", (2, 1, 4), mesh_dim_names=HSDP)
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    splits = {
        "right": (dp.size(), dp.get_local_rank()),
        "world": (8, torch.distributed.get_rank()),
        "shard": (mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()),
    }
    out: dict[str, Any] = {}
    for name, (replicas, rank) in splits.items():
        order = list(DistributedSampler(range(16), num_replicas=replicas, rank=rank, seed=1))
        out[name] = record_batches([order[:2], order[2:4]])
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh["dp_replicate", "dp_shard"])
    (model(torch.ones(2, 4)).sum() * meshsim.dataflow.loss_scale()).backward()
    for name, reference in (("issue", ISSUE), ("unnamed", UNNAMED), ("pp_tp", NO_DATA_PARALLEL)):
        try:
            meshsim.assert_gradient_sync(model, reference)
            out[name] = "pass"
        except (RolesUnknown, NothingCompared) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def test_the_issue_hsdp_code_passes_and_wrong_samplers_are_named() -> None:
    ranks = meshsim.run(_issue_step, 8, backend="threaded")
    meshsim.assert_data_parallel([r["right"] for r in ranks], ISSUE)  # the false failure
    assert {r["issue"] for r in ranks} == {"pass"}  # compared over (0, 4), ..., not vacuous

    with pytest.raises(DataflowMismatch) as world:
        meshsim.assert_data_parallel([r["world"] for r in ranks], ISSUE)
    assert "ranks 0 and 1 are TP peers" in str(world.value)
    assert "split over the whole world (8 ranks) instead of the data-parallel group " in (
        str(world.value)
    )
    with pytest.raises(DataflowMismatch) as shard:
        meshsim.assert_data_parallel([r["shard"] for r in ranks], ISSUE)
    assert "data-parallel ranks 0 and 4 (group 0, 4) both loaded" in str(shard.value)
    assert "not split over the data-parallel group" in str(shard.value)

    assert ranks[0]["unnamed"].startswith("RolesUnknown: the torch convention cannot tell")
    assert ranks[0]["pp_tp"].startswith(
        "NothingCompared: assert_gradient_sync compared nothing: the reference has no "
        "gradient_reduce group"
    )
    assert all(r["pp_tp"] == ranks[0]["pp_tp"] for r in ranks)


def test_a_data_check_with_nothing_to_compare_is_not_a_pass() -> None:
    one = meshsim.expect("torch", 1, mesh_shape=(1,), mesh_dim_names=("dp",))
    with pytest.raises(NothingCompared, match="a world of one rank"):
        meshsim.assert_data_parallel([record_batches([[0]], rank=0)], one)
    with pytest.raises(NothingCompared, match="no rank recorded a step"):
        meshsim.assert_data_parallel([record_batches([], rank=r) for r in range(8)], ISSUE)
