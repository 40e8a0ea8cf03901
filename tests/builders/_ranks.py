"""Run a builder on every rank of a fake world, one rank after another, without the harness."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshsim.builders import build
from meshsim.checks import Observation


def build_every_rank(framework: str, world: int, config: Mapping[str, Any]) -> list[Observation]:
    """Each rank's Observation: the fake backend builds real meshes, metadata only."""
    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            out.append(build(framework, world, config))
        finally:
            dist.destroy_process_group()
    return out


def on_rank(framework: str, world: int, config: Mapping[str, Any], rank: int) -> Observation:
    """One rank's Observation (cheap: the other ranks are not built)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return build(framework, world, config)
    finally:
        dist.destroy_process_group()
