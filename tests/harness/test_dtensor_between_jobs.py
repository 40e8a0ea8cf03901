"""DTensor code in consecutive jobs of the same warm workers (and fake ranks in turn).

DTensor caches sharding and redistribute plans keyed by meshes that compare equal across jobs;
without the harness clearing them, the second job reuses a plan naming a process group the first
job destroyed and fails with "Could not resolve the process group registered under the name N".
"""

from __future__ import annotations

import pytest

from meshsim.harness import run


def redistribute_sum() -> float:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    return float(sharded.redistribute(mesh, [Replicate(), Replicate()]).to_local().sum())


@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_dtensor_runs_in_consecutive_jobs(backend: str) -> None:
    for _ in range(3):
        assert run(redistribute_sum, 4, backend, timeout=60) == [120.0] * 4


def test_dtensor_on_fake_ranks_in_turn() -> None:
    run(redistribute_sum, 4, "fake", timeout=60)  # every rank in turn, one process
    run(redistribute_sum, 4, "fake", timeout=60)
