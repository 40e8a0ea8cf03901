"""The plugin in a real suite: a layout that follows a parametrised world size, config errors in
one line with a "did you mean", 2-D torch layouts, groups that must stay inside a node."""

from __future__ import annotations

import pytest

import meshsim
from meshsim.fixtures import parametrize_layouts


def test_meshsim_layout_follows_a_parametrised_world_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import meshsim
        from torch.distributed.device_mesh import init_device_mesh

        @pytest.mark.meshsim(world_size=[4, 8], backend="threaded")
        @pytest.mark.meshsim_layout(
            "torch", mesh_shape=lambda n: (2, n // 2), mesh_dim_names=("dp", "tp")
        )
        def test_mesh(rank, world_size, meshsim_expected):
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
            meshsim.assert_layout(meshsim.observe(mesh), meshsim_expected)
        """
    )
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_a_bad_layout_config_is_one_line_with_a_suggestion(pytester: pytest.Pytester) -> None:
    """Before: 50-70 lines of the fixture's source and no suggestion."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim(world_size=8, backend="fake")
        @pytest.mark.meshsim_layout("olmo-core", dp="hsdp", shard_degre=2)
        def test_mesh(rank, meshsim_expected):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert (
        "meshsim_layout('olmo-core', dp='hsdp', shard_degre=2) at world_size=8: olmo-core takes "
        "no config key(s) ['shard_degre'] (did you mean 'shard_degree' for 'shard_degre'?)" in out
    )
    assert "During handling" not in out
    assert "def meshsim_expected" not in result.stdout.str()  # no fixture source


@parametrize_layouts(8, "torch", mesh_dim_names=("dp", "tp"))
def test_parametrize_layouts_takes_the_dims_to_enumerate(layout_case: meshsim.LayoutCase) -> None:
    assert layout_case.config["mesh_dim_names"] == ("dp", "tp")
    assert len(layout_case.config["mesh_shape"]) == 2


def test_groups_that_must_stay_inside_a_node() -> None:
    plan = meshsim.expect("megatron", 16, tensor_model_parallel_size=8)
    meshsim.assert_within_nodes(plan, "tensor", 8)
    with pytest.raises(meshsim.GroupsCrossNodes) as caught:
        meshsim.assert_within_nodes(plan, ["tensor", "dp"], 4)
    text = str(caught.value)
    assert text.startswith("tensor: 2 of 2 groups cross nodes of 4 GPUs, e.g. (0, 1, 2, 3, 4, ")
    assert "dp: 8 of 8 groups cross nodes of 4 GPUs, e.g. (0, 8) spans nodes 0, 2" in text


def _tp_across_nodes() -> meshsim.Observation:
    from torch.distributed.device_mesh import init_device_mesh

    return meshsim.observe(init_device_mesh("cpu", (2, 4), mesh_dim_names=("tp", "dp")))


def test_live_groups_that_cross_a_node_are_named() -> None:
    """The mesh dims in the wrong order put tp across the two 4-GPU nodes."""
    observed = meshsim.run(_tp_across_nodes, 8, backend="threaded")
    meshsim.assert_within_nodes(observed, "dp", 4)
    with pytest.raises(meshsim.GroupsCrossNodes, match=r"tp: 4 of 4 groups cross nodes of 4 GPUs"):
        meshsim.assert_within_nodes(observed, "tp", 4)
    with pytest.raises(meshsim.UsageError, match="no rank observed a group named 'pp'"):
        meshsim.assert_within_nodes(observed, "pp", 4)


def test_distributed_fixture_is_built_once_and_shared(pytester: pytest.Pytester) -> None:
    """DeepSpeed's DistributedFixture: state built on N ranks once, used by several tests."""
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist
        from meshsim.fixtures import distributed_fixture

        RUNS = os.path.join(os.path.dirname(__file__), "runs.txt")

        @distributed_fixture(world_size=4, backend="gloo")
        def shards(rank, world_size):
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)  # a real collective while building
            with open(RUNS, "a") as f:
                f.write(f"{rank}\\n")
            return {"rank": rank, "total": float(t)}

        def test_in_the_parent(shards):
            assert [s["rank"] for s in shards] == [0, 1, 2, 3]
            assert {s["total"] for s in shards} == {10.0}

        @pytest.mark.meshsim(world_size=4, backend="threaded")
        def test_on_every_rank(rank, shards):
            assert shards["rank"] == rank  # each rank gets its own

        @pytest.mark.meshsim(world_size=2, backend="threaded")
        def test_wrong_world(rank, shards):
            pass

        def test_built_once():
            assert sorted(open(RUNS).read().split()) == ["0", "1", "2", "3"]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    assert "a distributed_fixture built on 4 ranks was passed to a body running on 2" in (
        result.stdout.str()
    )
