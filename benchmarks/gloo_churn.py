"""Section 1.1: warm gloo tests in a row, where earlier tests' destroyed groups get freed.

Two runs on one warm pool. ``tests``: world-8 layout tests back to back (section 1's work:
a 3-D mesh, a slice, a flatten, an all-gather), each test's wall time, to show the spread,
not only the median: a test that pays for freeing earlier tests' groups is an outlier.
``cycles``: jobs at worlds 4 and 8 alternately that build 1 to 7 groups and a 2-D mesh and
leave them in a reference cycle (as frameworks and a sliced ``DeviceMesh`` do); the total.
``held``: world-2 jobs that each replace 20 groups a module global holds (as megatron-core's
``parallel_state`` does until its next initialize); the median and the total.

    python benchmarks/gloo_churn.py [--quick] [--json out.json]

Compare commits by running it from each one's tree (``PYTHONPATH=<tree>``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import _baselines as base
from _common import fmt_s, loadavg, md_table, section_main


def groups_in_a_cycle(count: int) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    groups = [dist.new_group(list(range(world))) for _ in range(count)]
    for group in groups:
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        assert total.item() == world
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.get_group("tp"))
    assert total.item() == world // 2
    holder: list[Any] = [groups, mesh]
    holder.append(holder)
    return dist.get_rank()


def groups_in_a_global(count: int) -> int:
    import json

    import torch.distributed as dist

    json._meshsim_churn_groups = [dist.new_group([0, 1]) for _ in range(count)]  # type: ignore[attr-defined]
    return dist.get_rank()


def run(quick: bool) -> dict[str, Any]:
    from meshsim.harness import run as run_ranks
    from meshsim.harness import shutdown

    tests, jobs = (20, 40) if quick else (40, 100)
    load = loadavg()[0]
    base.meshsim_test(8, "gloo")  # the pool's boot is section 1's "first call", not this
    walls = []
    for _ in range(tests):
        start = time.perf_counter()
        base.meshsim_test(8, "gloo")
        walls.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(jobs):
        world = (4, 8)[i % 2]
        ranks = run_ranks(groups_in_a_cycle, world, "gloo", timeout=300, args=(1 + i % 7,))
        assert ranks == list(range(world))
    cycles = time.perf_counter() - start
    held = []
    for _ in range(jobs // 5):
        start = time.perf_counter()
        run_ranks(groups_in_a_global, 2, "gloo", timeout=300, args=(20,))
        held.append(time.perf_counter() - start)
    shutdown()
    ordered = sorted(walls)
    return {
        "load_average": load,
        "tests": {
            "n": tests,
            "median_s": statistics.median(walls),
            "p90_s": ordered[int(0.9 * (tests - 1))],
            "max_s": ordered[-1],
            "total_s": sum(walls),
            "walls_s": walls,
        },
        "cycles": {"n": jobs, "total_s": cycles},
        "held": {"n": len(held), "median_s": statistics.median(held), "total_s": sum(held)},
    }


def render(result: dict[str, Any]) -> str:
    t, c, h = result["tests"], result["cycles"], result["held"]
    median = fmt_s(h["median_s"])
    rows = [
        [
            f"{t['n']} world-8 tests",
            fmt_s(t["median_s"]),
            fmt_s(t["p90_s"]),
            fmt_s(t["max_s"]),
            fmt_s(t["total_s"]),
        ],
        [f"{c['n']} jobs, groups in cycles", "", "", "", fmt_s(c["total_s"])],
        [f"{h['n']} jobs, 20 groups in a global", median, "", "", fmt_s(h["total_s"])],
    ]
    table = md_table(["run", "median", "p90", "max", "total"], rows)
    return f"{table}\n\nLoad average (1 min) at the start: {result['load_average']:.1f}."


if __name__ == "__main__":
    section_main(__doc__, run, render)
