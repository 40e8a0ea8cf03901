"""A wiring hint blames the loader or the wrapper only when the mesh they were handed is right.

The program here is correct but for one thing: its mesh dims are in the wrong order (``(tp, dp)``
where the reference says ``(dp, tp)``). Its sampler reads the mesh's dp rank and its DDP reduces
over the mesh's dp group, as they should. Before, the hints said "the sampler split over tp
instead of dp" and blamed the wrapper: both correct. Now the hint names the mesh. With the mesh
right and the sampler wrong, the sampler is still blamed.
"""

from __future__ import annotations

import pytest
import torch

import meshsim
from meshsim import DataflowMismatch

EXP = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))


def _load(order: tuple[str, str], sampler_dim: str) -> str:
    """Each rank loads the shard of its ``sampler_dim`` rank; returns the finding or ''."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
    shard = mesh[sampler_dim].get_local_rank()
    record = meshsim.record_batches([[2 * step + shard] for step in range(2)])
    try:
        meshsim.assert_data_parallel(record, EXP)
    except DataflowMismatch as error:
        return str(error)
    return ""


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_a_correct_sampler_on_a_wrong_mesh_blames_the_mesh(backend: str) -> None:
    found = meshsim.run(_load, 4, backend=backend, args=(("tp", "dp"), "dp"))[0]
    assert (
        "Likely mistake: the mesh itself: its 'tp' dim holds (0, 2) on rank 0 where the "
        "reference has (0, 1) (also wrong: 'dp')" in found
    )
    assert "sampler" not in found.split("Likely mistake:")[1]


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_a_wrong_sampler_on_a_right_mesh_is_still_blamed(backend: str) -> None:
    found = meshsim.run(_load, 4, backend=backend, args=(("dp", "tp"), "tp"))[0]
    assert "Likely mistake:" in found and "the mesh itself" not in found


def _train(order: tuple[str, str]) -> str:
    """DDP over the mesh's dp group, every rank the same input: correct but for the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=mesh["dp"].get_group())
    x = torch.ones(3, 4)
    (model(x).square().mean() * meshsim.dataflow.loss_scale()).backward()
    try:
        meshsim.assert_gradient_sync(model, EXP)
    except DataflowMismatch as error:
        return str(error)
    return ""


def test_a_correct_wrapper_on_a_wrong_mesh_blames_the_mesh() -> None:
    assert meshsim.run(_train, 4, backend="threaded", args=(("dp", "tp"),)) == [""] * 4
    found = meshsim.run(_train, 4, backend="threaded", args=(("tp", "dp"),))[0]
    assert "Likely mistake: the mesh itself: its 'tp' dim holds (0, 2) on rank 0" in found


def test_data_flow_asserts_on_the_fake_tier_say_why_they_cannot_run() -> None:
    """Before: "two records for rank 0", or a torch INTERNAL ASSERT from all_gather_object."""

    def body() -> None:
        meshsim.assert_data_parallel(meshsim.record_batches([[0]]), EXP)

    with pytest.raises(meshsim.RankFailure) as caught:
        meshsim.run(body, 4, backend="fake")
    assert (
        "UsageError: assert_data_parallel(record, ...) inside a rank gathers every rank's "
        in str(caught.value)
    )
    assert "fake backend moves no data" in str(caught.value)

    def gradients() -> None:
        meshsim.assert_gradient_sync(torch.nn.Linear(2, 2), EXP)

    with pytest.raises(meshsim.RankFailure, match="UsageError: assert_gradient_sync gathers"):
        meshsim.run(gradients, 4, backend="fake")
