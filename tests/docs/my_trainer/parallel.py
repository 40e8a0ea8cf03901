"""A trainer's mesh builder, as the getting-started page imagines it: OLMo-core's HSDP layout."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def build_world_mesh(world_size: int, replicas: int = 2) -> DeviceMesh:
    """HSDP over ``replicas`` groups: the mesh OLMo-core builds for ``dp="hsdp"``."""
    return init_device_mesh(
        "cpu",
        (replicas, world_size // replicas),
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )
