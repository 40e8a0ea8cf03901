"""The reference Layout against torch's real DeviceMesh, every rank, on the fake backend.

The fake process group builds real DeviceMesh objects and process groups (metadata only), so
this checks meshsim's algebra against torch's own on any machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from meshsim import Layout, LayoutError, torch_private

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

CASES = [
    (("dp", 2), ("tp", 4)),
    (("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2)),
    (("dp_replicate", 2), ("dp_shard", 3), ("cp", 1), ("tp", 2)),
    (("a", 3), ("b", 1), ("c", 2), ("d", 2), ("e", 1)),
]


def _ranks_on(mesh: object, dim: str) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(mesh.get_group(dim)))  # type: ignore[attr-defined]


@pytest.fixture
def fake_rank() -> Iterator[object]:
    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch_private.reset_mesh_resources()  # torch < 2.10 keeps meshes in a global registry
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("axes", CASES, ids=lambda a: "x".join(f"{n}{s}" for n, s in a))
def test_every_dim_slice_and_flatten_matches_torch(
    axes: tuple[tuple[str, int], ...], fake_rank
) -> None:  # type: ignore[no-untyped-def]
    layout = Layout(list(axes))
    names = layout.dim_names
    subsets = [c for k in (2, 3) for c in itertools.combinations(names, k)]
    for rank in range(layout.world_size):
        fake_rank(rank, layout.world_size)
        mesh = init_device_mesh("cpu", layout.shape, mesh_dim_names=names)
        assert tuple(mesh.get_coordinate()) == tuple(layout.coordinate(rank).values())
        for dim in names:
            assert _ranks_on(mesh, dim) == layout.group_of(rank, dim), (rank, dim)
            assert mesh.get_local_rank(dim) == layout.local_rank(rank, dim)
        for dims in subsets:
            sub = mesh[dims]
            assert sub.mesh.tolist() == layout[dims].mesh_of(rank).tolist(), (rank, dims)
            flat = sub._flatten()
            expected = layout[dims].flatten()
            assert tuple(flat.mesh.tolist()) == expected.group_of(rank), (rank, dims)
            assert flat.get_local_rank() == expected.local_rank(rank)


@pytest.fixture(autouse=True)
def _described(installed_torch) -> None:  # type: ignore[no-untyped-def]
    """Every test here holds the reference against the torch installed."""


@pytest.mark.skipif(
    not hasattr(DeviceMesh, "_unflatten"), reason=f"torch {torch.__version__} has no _unflatten"
)
def test_unflatten_matches_torch(fake_rank) -> None:  # type: ignore[no-untyped-def]
    layout = Layout(world=16)
    views = [
        ((2, 4, 2), ("pp", "batch", "tp")),
        ((2, 2, 2, 2), ("pp", "dp_replicate", "fsdp", "tp")),
    ]
    for rank in range(16):
        fake_rank(rank, 16)
        world = init_device_mesh("cpu", (16,), mesh_dim_names=("world",))
        for sizes, names in views:
            torch_view = world._unflatten(0, sizes, names)
            model_view = layout.unflatten("world", sizes, names)
            for dim in names:
                assert _ranks_on(torch_view, dim) == model_view.group_of(rank, dim)


def test_slicing_errors_match_torch_exception_types(fake_rank) -> None:  # type: ignore[no-untyped-def]
    fake_rank(0, 8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    layout = Layout(dp=2, cp=2, tp=2)
    attempts = [
        (lambda m: m["cp", "dp"]),
        (lambda m: m["nope"]),
    ]
    for attempt in attempts:
        with pytest.raises(Exception) as real:
            attempt(mesh)
        with pytest.raises(LayoutError) as model:
            attempt(layout)
        assert type(real.value).__name__ == model.value.upstream
    with pytest.raises((ValueError, RuntimeError), match="already exists") as real:
        mesh["dp", "cp"]._flatten("tp")
    with pytest.raises(LayoutError, match="already exists") as model:
        layout["dp", "cp"].flatten(name="tp")
    assert model.value.upstream == type(real.value).__name__  # RuntimeError before torch 2.10
