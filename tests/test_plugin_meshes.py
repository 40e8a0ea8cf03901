"""Two meshes, one job, under the pytest plugin: a rank body and a reference layout."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_rank_bodies_and_layouts_check_their_meshes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from torch.distributed.device_mesh import init_device_mesh

        import meshsim

        @pytest.mark.meshsim(world_size=4, backend="threaded")
        def test_trainer_mesh_agrees(rank):
            model = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            trainer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
            meshsim.assert_meshes_agree(
                {"model": model, "trainer": trainer},
                same_groups=[("model:dp", "trainer:dp_shard")],
            )

        @pytest.mark.meshsim(world_size=4, backend="threaded")
        def test_trainer_mesh_transposed(rank):
            model = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            trainer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
            meshsim.assert_meshes_agree({"model": model, "trainer": trainer})

        @pytest.mark.meshsim_layout(
            "olmo-core", world_size=8, dp="hsdp", num_replicas=2, expert_mesh_ep=4
        )
        def test_expert_mesh_names(meshsim_expected):
            meshsim.assert_meshes_agree(meshsim_expected)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*MeshesDisagree*rank 1: meshes 'model' and 'trainer', data rank: model (dp) gives "
            "data rank 0 of 2, trainer (dp) gives 1 of 2*",
            "*ranks 0-7: meshes 'main' and 'expert', two names, one group*",
        ],
        consecutive=False,
    )
