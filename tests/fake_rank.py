"""One simulated rank at a time in this process, on torch's fake backend (metadata only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from meshsim import torch_private


@contextmanager
def as_fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Be ``rank`` of ``world_size`` inside the block, and forget its meshes afterwards.

    torch < 2.10 keeps flattened meshes in process-global registries keyed by meshes that
    compare equal by value, so without the reset the next simulated rank would get this
    rank's flattened meshes back.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch_private.reset_mesh_resources()
