"""The meshsim_dataflow fixture in a downstream-style test: both checks run inside the ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler


@pytest.mark.meshsim(world_size=8, backend=["threaded"])
@pytest.mark.meshsim_layout("olmo-core", dp="fsdp", cp=2, tp=2)
def test_fixture_checks_a_correctly_wired_step(meshsim_dataflow) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    sampler = DistributedSampler(
        range(8), num_replicas=mesh["dp"].size(), rank=mesh["dp"].get_local_rank(), seed=3
    )
    record = meshsim_dataflow.record([list(sampler)[:2], list(sampler)[2:]])
    meshsim_dataflow.assert_batches(record)

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    (model(torch.ones(2, 4)).sum() * meshsim_dataflow.loss_scale()).backward()
    meshsim_dataflow.assert_gradients(model)


def test_fixture_on_the_fake_tier_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim(world_size=2, backend="fake")
        @pytest.mark.meshsim_layout("torch", mesh_shape=(2,), mesh_dim_names=("dp",))
        def test_x(meshsim_dataflow):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fake backend moves no*"])
