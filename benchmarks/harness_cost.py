"""Per-call cost of each meshsim.run tier beside a spawn-per-test baseline, same work everywhere.

The work: (init the process group,) build a 3-D DeviceMesh with ``init_device_mesh`` on
"cpu", slice two dims and ``_flatten`` them, read ``get_process_group_ranks`` of every dim,
``all_gather`` the ranks on real tiers, tear down. The baseline is what
``MultiProcessTestCase`` does per test: ``torch.multiprocessing`` spawn of fresh interpreters
(FileStore rendezvous), measured in the same run.

    python benchmarks/harness_cost.py [--worlds 2 4 8] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {1: (1, 1, 1), 2: (1, 1, 2), 4: (1, 2, 2), 8: (2, 2, 2), 16: (2, 2, 4)}


def mesh_work(world_size: int, real: bool) -> dict[str, Any]:
    """The per-rank work (the process group is already initialised)."""
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


def harness_body(world_size: int) -> dict[str, Any]:
    from meshsim.harness import context

    return mesh_work(world_size, real=context().backend != "fake")


def _spawned_rank(rank: int, world_size: int, store_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        mesh_work(world_size, real=True)
    finally:
        dist.destroy_process_group()


#: Baseline calls that crashed in teardown (SIGABRT "terminate called without an active
#: exception"): retried, counted, reported.
SPAWN_FLAKES: list[str] = []


def spawn_baseline(world_size: int) -> None:
    """One test the MultiProcessTestCase way: fresh interpreters, FileStore, gloo."""
    import torch.multiprocessing as mp

    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="meshsim-bench-") as tmp:
            store = os.path.join(tmp, "store")
            try:
                mp.spawn(_spawned_rank, args=(world_size, store), nprocs=world_size)
                return
            except mp.ProcessExitedException as exc:
                SPAWN_FLAKES.append(f"world {world_size}: {exc}")
    raise RuntimeError(f"spawn baseline failed 3 times: {SPAWN_FLAKES[-3:]}")


def _time(fn: Any, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def measure(worlds: list[int], reps: int, spawn_reps: int) -> list[dict[str, Any]]:
    from meshsim.harness import run, shutdown

    rows: list[dict[str, Any]] = []
    for world in worlds:
        row: dict[str, Any] = {"world_size": world}
        for backend in ("fake", "threaded", "gloo"):
            first_start = time.perf_counter()
            run(harness_body, world, backend, timeout=300, args=(world,))  # warm-up / cold
            row[f"{backend}_first_s"] = time.perf_counter() - first_start
            call = functools.partial(run, harness_body, world, backend, args=(world,))
            row[f"{backend}_s"] = statistics.median(_time(call, reps))
        baseline = functools.partial(spawn_baseline, world)
        row["spawn_s"] = statistics.median(_time(baseline, spawn_reps))
        rows.append(row)
    shutdown()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'world':>5} | {'fake':>8} | {'threaded':>8} | {'gloo warm':>9} | "
        f"{'gloo cold':>9} | {'spawn':>8} | {'spawn/gloo':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['world_size']:>5} | {r['fake_s'] * 1e3:>6.1f}ms | "
            f"{r['threaded_s'] * 1e3:>6.1f}ms | {r['gloo_s'] * 1e3:>7.1f}ms | "
            f"{r['gloo_first_s']:>8.2f}s | {r['spawn_s']:>7.2f}s | "
            f"{r['spawn_s'] / r['gloo_s']:>9.0f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per tier (median)")
    parser.add_argument("--spawn-reps", type=int, default=3, help="repetitions of the baseline")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    bad = [w for w in args.worlds if w not in SHAPES]
    if bad:
        parser.error(f"--worlds must be among {sorted(SHAPES)}, got {bad}")
    rows = measure(args.worlds, args.reps, args.spawn_reps)
    print_table(rows)
    if SPAWN_FLAKES:
        print(f"spawn baseline crashed (and was retried) {len(SPAWN_FLAKES)} time(s):")
        print("\n".join(f"  {flake}" for flake in SPAWN_FLAKES))
    if args.json:
        import torch

        meta = {
            "spawn_flakes": SPAWN_FLAKES,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "reps": args.reps,
            "spawn_reps": args.spawn_reps,
            "unit": "seconds per call (median)",
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
