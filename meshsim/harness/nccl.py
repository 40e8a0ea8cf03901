"""The nccl tier: one pool worker per GPU, ``torch.cuda.set_device(rank)``, real NCCL."""

from __future__ import annotations

from typing import Any

from meshsim.errors import NotEnoughGPUs
from meshsim.harness.backend import Job
from meshsim.harness.gloo import ProcessBackend
from meshsim.harness.outcome import RunResult


def gpu_count() -> int:
    """GPUs torch can see in this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class NcclBackend(ProcessBackend):
    """Like gloo, with rank r on ``cuda:r``; needs ``world_size`` GPUs on this machine."""

    name = "nccl"
    gpus = True

    def run(self, job: Job) -> RunResult[Any]:
        found = gpu_count()
        if found < job.world_size:
            raise NotEnoughGPUs(
                f"backend='nccl' with world_size={job.world_size} needs {job.world_size} GPUs "
                f"(one per rank) but this machine has {found}; use backend='gloo' (CPU "
                "processes) or backend='threaded', or lower world_size"
            )
        return super().run(job)
