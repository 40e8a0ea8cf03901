"""The per-test work, and the two ways people run it today: spawn-per-test and fork-per-test.

The work (one "layout test"), identical on every path: (init the process group,) build a 3-D
``DeviceMesh`` with ``init_device_mesh("cpu", ...)``, slice two dims and ``_flatten`` them, read
``get_process_group_ranks`` of every dim, ``all_gather`` the global ranks over the world (real
tiers only), check the result against the expected groups, tear down.
``mesh_work`` is the single definition of that work: every column of the per-test table runs it.

* spawn-per-test: what ``torch.testing._internal.common_distributed.MultiProcessTestCase`` does
  for every test: ``spawn`` one fresh interpreter per rank (each imports torch), ``FileStore``
  rendezvous, gloo.
* fork-per-test: what OLMo-core's ``olmo_core.testing.run_distributed_test`` does (its default
  for gloo): ``torch.multiprocessing.start_processes(..., start_method="fork")``, so children
  inherit the parent's imported torch. OLMo-core rendezvous over TCP on a free port; this
  baseline uses a ``FileStore`` like the others so that no port can collide on a shared machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: world size -> 3-D mesh shape (pp, dp, tp)
SHAPES = {
    1: (1, 1, 1),
    2: (1, 1, 2),
    4: (1, 2, 2),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
}


def mesh_work(world_size: int, real: bool) -> dict[str, Any]:
    """The per-rank work (the default process group is already initialised)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", SHAPES[world_size], mesh_dim_names=("pp", "dp", "tp"))
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    ranks = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in ("pp", "dp", "tp")}
    ranks["dp_tp"] = dist.get_process_group_ranks(flat.get_group())
    if real:
        out = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(out, torch.tensor([dist.get_rank()]))
        ranks["all"] = [int(t) for t in out]
    return ranks


def expected_work(world_size: int, rank: int, real: bool) -> dict[str, Any]:
    """What ``mesh_work`` must return on ``rank`` (pure Python: the row-major mesh)."""
    pp, dp, tp = SHAPES[world_size]
    c_pp, rest = divmod(rank, dp * tp)
    c_dp, c_tp = divmod(rest, tp)
    out: dict[str, Any] = {
        "pp": [p * dp * tp + c_dp * tp + c_tp for p in range(pp)],
        "dp": [c_pp * dp * tp + d * tp + c_tp for d in range(dp)],
        "tp": [c_pp * dp * tp + c_dp * tp + t for t in range(tp)],
        "dp_tp": [c_pp * dp * tp + i for i in range(dp * tp)],
    }
    if real:
        out["all"] = list(range(world_size))
    return out


def check(world_size: int, rank: int, got: dict[str, Any], real: bool) -> None:
    want = expected_work(world_size, rank, real)
    if got != want:
        raise AssertionError(f"rank {rank}: got {got}, expected {want}")


def harness_body(world_size: int) -> dict[str, Any]:
    """The body meshsim.run runs on every rank."""
    from meshsim.harness import context

    return mesh_work(world_size, real=context().backend != "fake")


def meshsim_test(world_size: int, backend: str) -> None:
    """One layout test with meshsim: run the body on every rank, check every rank's answer."""
    from meshsim.harness import run

    values = run(harness_body, world_size, backend, timeout=300, args=(world_size,))
    for rank, got in enumerate(values):
        check(world_size, rank, got, real=backend != "fake")


def meshsim_gloo_rebuilt(world_size: int) -> None:
    """The gloo tier as before issue 11: the warm workers rebuild the world group every test."""
    from meshsim.harness import gloo

    gloo.KEEP_WORLD = False
    try:
        meshsim_test(world_size, "gloo")
    finally:
        gloo.KEEP_WORLD = True


# ---------------------------------------------------------------------------- baselines


def _rank_main(rank: int, world_size: int, store_path: str) -> None:
    """One rank of a baseline test (runs in the spawned or forked child)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        check(world_size, rank, mesh_work(world_size, real=True), real=True)
    finally:
        dist.destroy_process_group()


#: Baseline calls that crashed (e.g. SIGABRT in gloo teardown): retried, counted, reported.
FLAKES: list[str] = []


def _baseline(world_size: int, start_method: str) -> None:
    import torch.multiprocessing as mp

    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="meshsim-bench-") as tmp:
            store = os.path.join(tmp, "store")
            try:
                mp.start_processes(
                    _rank_main,
                    args=(world_size, store),
                    nprocs=world_size,
                    join=True,
                    start_method=start_method,
                )
                return
            except mp.ProcessExitedException as exc:
                FLAKES.append(f"{start_method} world {world_size}: {exc}")
    raise RuntimeError(f"{start_method} baseline failed 3 times: {FLAKES[-3:]}")


def spawn_per_test(world_size: int) -> None:
    """One test the MultiProcessTestCase way: fresh interpreters, FileStore, gloo."""
    _baseline(world_size, "spawn")


def fork_per_test(world_size: int) -> None:
    """One test the OLMo-core ``run_distributed_test`` way: forked children, gloo."""
    _baseline(world_size, "fork")
