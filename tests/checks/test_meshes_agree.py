"""Two meshes, one job: data ranks, names and communicators compared rank by rank.

The live cases build real meshes on threaded and gloo ranks; each planted mistake is one a
framework shipped (a Trainer's mesh in another dim order, two models' 1-D whole-world meshes on
one communicator, as transformers#48383 describes for two TP models in one process).
"""

from __future__ import annotations

import pytest

import meshsim
from meshsim.checks.agreement import Rules, compare, layout_views
from meshsim.errors import RankFailure, UsageError
from meshsim.model.layout import Layout

BACKENDS = ["threaded", "gloo"]


def test_reference_meshes_naming_one_group_twice_are_named_until_meant() -> None:
    expected = meshsim.expect("olmo-core", 8, dp="hsdp", num_replicas=2, expert_mesh_ep=4)
    found = meshsim.check_meshes(expected)
    assert {d.aspect for d in found} == {"two names, one group"}
    assert len(found) == 16  # two pairs of dims, eight ranks
    assert str(found[1]) == (
        "rank 0: meshes 'main' and 'expert', two names, one group: main:dp_shard and "
        "expert:ep_shard both hold (0, 1, 2, 3); if meant, declare it: "
        "same_groups=[('main:dp_shard', 'expert:ep_shard')] "
        "(meshsim meshes --same main:dp_shard=expert:ep_shard)"
    )
    meant = [("main:dp_shard", "expert:ep_shard"), ("expert:ep_replicate", "main:dp_replicate")]
    assert meshsim.check_meshes(expected, same_groups=meant) == []


def test_data_rank_from_a_mesh_in_another_dim_order() -> None:
    model = layout_views("model", Layout([("dp", 2), ("tp", 2)]), 4)
    trainer = layout_views("trainer", Layout([("tp", 2), ("dp_shard", 2)]), 4)
    rules = Rules.of(same_groups=[("model:dp", "trainer:dp_shard")])
    found = {r: compare(r, [model[r], trainer[r]], rules) for r in range(4)}
    names = ["two names, one group", "one name, two groups ('tp')", "two names, one group"]
    assert [d.aspect for d in found[0]] == names  # model's dp is trainer's tp, and back
    assert [d.aspect for d in found[3]] == names  # the diagonal's data ranks agree
    assert [d.aspect for d in found[1]] == ["data rank", *names]
    assert str(found[1][0]) == (
        "rank 1: meshes 'model' and 'trainer', data rank: model (dp) gives data rank 0 of 2, "
        "trainer (dp_shard) gives 1 of 2: a loader reading one mesh and a wrapper reducing "
        "over the other feed this rank's peers different batches"
    )


def test_expert_meshes_have_no_data_rank_unless_named() -> None:
    dense = layout_views("dense", Layout([("fsdp", 2), ("tp", 2)]), 4)
    expert = layout_views("expert", Layout([("efsdp", 1), ("ep", 4)]), 4)
    assert compare(2, [dense[2], expert[2]]) == []
    rules = Rules.of(data_dims={"expert": "efsdp"})
    (found,) = compare(2, [dense[2], expert[2]], rules)
    assert found.aspect == "data rank" and "gives 0 of 1" in found.detail


@pytest.mark.parametrize("world", [8, 16, 32])
def test_names_that_meet_only_through_a_size1_dim_are_no_finding(world: int) -> None:
    # At world 8 dp_shard is 1, so train:dp_replicate and eval:dp both hold (0, 4); at 16
    # they part. One test over every world size needs no per-size same_groups.
    train = layout_views(
        "train", Layout([("dp_replicate", 2), ("dp_shard", world // 8), ("tp", 4)]), world
    )
    evaluation = layout_views("eval", Layout([("dp", world // 4), ("tp", 4)]), world)
    assert [d for r in range(world) for d in compare(r, [train[r], evaluation[r]])] == []


def test_a_coincidence_beside_the_same_size1_dims_is_still_named() -> None:
    def findings(a: Layout, b: Layout) -> set[str]:
        va, vb = layout_views("a", a, 8), layout_views("b", b, 8)
        return {d.subject for r in range(8) for d in compare(r, [va[r], vb[r]])}

    same_side = findings(
        Layout([("pp", 1), ("dp", 2), ("tp", 4)]), Layout([("pp", 1), ("data", 2), ("tp", 4)])
    )
    assert same_side == {"a:dp = b:data"}  # pp would grow both alike
    other_side = findings(
        Layout([("dp", 2), ("cp", 1), ("tp", 4)]), Layout([("cp", 1), ("data", 2), ("tp", 4)])
    )
    assert other_side == set()  # cp 2 would give dp (0, 8) and data (0, 4)


def _train_and_eval_meshes() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    train = init_device_mesh("cpu", (2, 1, 4), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    evaluation = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return [str(d) for d in meshsim.check_meshes({"train": train, "eval": evaluation})]


def test_live_train_and_eval_meshes_meeting_through_a_size1_dim_agree() -> None:
    assert list(meshsim.run(_train_and_eval_meshes, 8, backend="threaded")) == [[]] * 8


def test_bad_rules_are_usage_errors() -> None:
    expected = meshsim.expect("olmo-core", 8, dp="hsdp", num_replicas=2, expert_mesh_ep=4)
    with pytest.raises(UsageError, match=r"no mesh named \['trainer'\]"):
        meshsim.check_meshes(expected, data_dims={"trainer": "dp"})
    with pytest.raises(UsageError, match="pairs of 'mesh:dim'"):
        meshsim.check_meshes(expected, same_groups=[("dp_shard", "ep_shard")])
    with pytest.raises(UsageError, match="has dims"):
        meshsim.check_meshes(expected, data_dims={"main": "dp"})


def _agreeing_meshes() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    model = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    trainer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    found = meshsim.check_meshes(
        {"model": model, "trainer": trainer}, same_groups=[("model:dp", "trainer:dp_shard")]
    )
    return [str(d) for d in found]


def _transposed_trainer_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    trainer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp_shard"))
    meshsim.assert_meshes_agree({"model": model, "trainer": trainer})


def _two_models_whole_world_tp() -> list[tuple[str, str]]:
    from torch.distributed.device_mesh import init_device_mesh

    policy = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    found = meshsim.check_meshes({"policy": policy, "ref": reference}, independent=True)
    return [(d.aspect, d.detail) for d in found]


def _two_models_own_groups() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    policy = init_device_mesh("cpu", (4,), mesh_dim_names=("policy_tp",))
    group = dist.new_group(list(range(4)))
    reference = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ref_tp",))
    return [
        str(d) for d in meshsim.check_meshes({"policy": policy, "ref": reference}, independent=True)
    ]


def _two_models_same_name_own_groups() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    policy = DeviceMesh.from_group(dist.new_group([0, 1, 2, 3]), "cpu", mesh_dim_names=("tp",))
    reference = DeviceMesh.from_group(dist.new_group([0, 1, 2, 3]), "cpu", mesh_dim_names=("tp",))
    assert policy == reference and policy.get_group() is not reference.get_group()
    found = meshsim.check_meshes({"policy": policy, "ref": reference}, independent=True)
    return [d.aspect for d in found]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_models_whose_meshes_compare_equal(backend: str) -> None:
    per_rank = list(meshsim.run(_two_models_same_name_own_groups, 4, backend=backend))
    assert per_rank == [["equal meshes", "equal sub-meshes"]] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_agreeing_live_meshes_pass(backend: str) -> None:
    assert list(meshsim.run(_agreeing_meshes, 4, backend=backend)) == [[]] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_live_transposed_trainer_mesh_is_named_by_rank(backend: str) -> None:
    with pytest.raises(RankFailure) as failure:
        meshsim.run(_transposed_trainer_mesh, 4, backend=backend)
    text = str(failure.value)
    assert "MeshesDisagree" in text
    assert "rank 1: meshes 'model' and 'trainer', data rank: model (dp) gives data rank 0 of 2" in (
        text
    )
    # Every rank fails (the tp dims differ everywhere); only 1 and 2 get another data rank.
    assert [o.rank for o in failure.value.failures] == [0, 1, 2, 3]
    assert "rank 0: meshes 'model' and 'trainer', data rank" not in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_models_on_one_communicator(backend: str) -> None:
    per_rank = list(meshsim.run(_two_models_whole_world_tp, 4, backend=backend))
    aspects = [aspect for aspect, _ in per_rank[0]]
    assert aspects == ["equal meshes", "shared communicator"]
    assert "policy:tp and ref:tp are one process group over (0, 1, 2, 3)" in per_rank[0][1][1]
    assert all(found == per_rank[0] for found in per_rank)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_models_with_their_own_groups_pass(backend: str) -> None:
    assert list(meshsim.run(_two_models_own_groups, 4, backend=backend)) == [[]] * 4
