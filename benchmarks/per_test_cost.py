"""Section 1: what one layout test costs, per meshsim tier and per baseline, in the same run.

For each world size: meshsim's fake, threaded and gloo (warm pool, world process group kept
between tests) tiers, the gloo tier as it was before (warm pool, world rebuilt every test), the
gloo tier's first call (a cold pool: every worker imports torch), and the two baselines of
``_baselines``
(spawn-per-test as MultiProcessTestCase, fork-per-test as OLMo-core's run_distributed_test).
Every variant does the same work (``_baselines.mesh_work``) and checks every rank's answer.
Variants are measured interleaved; medians are of wall time per test, each with the median CPU
time of the parent, its children and its pool workers (the machine is shared: CPU time is the
steadier number). The pool is sized for two worlds, so the kept-world and rebuilt-world gloo
variants use separate workers and do not break each other's world.

    python benchmarks/per_test_cost.py [--quick] [--json out.json]
"""

from __future__ import annotations

import functools
import os
from typing import Any

import _baselines as base
from _common import (
    cell,
    fmt_ratio,
    interleaved,
    loadavg,
    md_table,
    ratio,
    sample,
    section_main,
)

TIERS = ("fake", "threaded", "gloo")
BASELINES = ("fork", "spawn")


def run(quick: bool) -> dict[str, Any]:
    from meshsim.harness import pool, shutdown

    worlds = [2, 4, 8]
    rounds = 3 if quick else 7
    # The spawn baseline costs seconds per call; bound its share of the run.
    budget = {"spawn": 15.0 if quick else 60.0, "fork": 15.0 if quick else 60.0}
    pool.POOL_SIZE = 2 * max(worlds)
    rows = []
    load_start = loadavg()
    for world in worlds:
        row: dict[str, Any] = {"world_size": world, "load_average": loadavg()}
        shutdown()  # a cold pool: the first gloo call boots `world` workers
        wall, cpu = sample(functools.partial(base.meshsim_test, world, "gloo"))
        row["gloo_first_call"] = {"median_s": wall, "cpu_median_s": cpu, "n": 1}
        variants = {t: functools.partial(base.meshsim_test, world, t) for t in TIERS}
        variants["gloo_rebuilt"] = functools.partial(base.meshsim_gloo_rebuilt, world)
        variants["fork"] = functools.partial(base.fork_per_test, world)
        variants["spawn"] = functools.partial(base.spawn_per_test, world)
        # Warm the in-process tiers (first-use imports) and fork (first fork after imports);
        # a spawn call is always cold, that is the point of it.
        row.update(
            interleaved(
                variants,
                rounds,
                budget_s=budget,
                warmup=("fake", "threaded", "gloo_rebuilt", "fork"),
            )
        )
        rows.append(row)
    shutdown()
    return {
        "rows": rows,
        "rounds": rounds,
        "budget_s": budget,
        "baseline_flakes": list(base.FLAKES),
        "load_average_start": load_start,
        "load_average_end": loadavg(),
    }


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    head = [
        "world",
        "meshsim fake",
        "meshsim threaded",
        "meshsim gloo (warm pool, world kept)",
        "gloo, world rebuilt per test (before)",
        "gloo first call (cold pool)",
        "fork-per-test",
        "spawn-per-test",
    ]
    body = [
        [
            str(r["world_size"]),
            cell(r.get("fake")),
            cell(r.get("threaded")),
            cell(r.get("gloo")),
            cell(r.get("gloo_rebuilt")),
            cell(r.get("gloo_first_call")),
            cell(r.get("fork")),
            cell(r.get("spawn")),
        ]
        for r in rows
    ]
    ratios_head = ["world"] + [f"{b} ÷ {t}" for b in BASELINES for t in TIERS]
    ratios = [
        [str(r["world_size"])]
        + [fmt_ratio(ratio(r.get(b), r.get(t))) for b in BASELINES for t in TIERS]
        for r in rows
    ]
    counts = ", ".join(
        f"{name} n={rows[-1].get(name, {}).get('n', 0)}" for name in (*TIERS, *BASELINES)
    )
    notes = [
        "Load average (1 min) per world: "
        + ", ".join(f"{r['world_size']}: {r['load_average'][0]:.1f}" for r in rows)
        + f" on {os.cpu_count()} cores; numbers are noisy when it exceeds that.",
        "Median wall time per test, CPU time of all processes in brackets "
        f"({counts} at world {rows[-1]['world_size']}; rounds interleaved). "
        "Work per test: init the process group, `init_device_mesh` 3-D, slice "
        "`dp,tp` and `_flatten`, `get_process_group_ranks` of every dim, all-gather of ranks "
        "(not on fake), destroy, check every rank's answer.",
    ]
    if result.get("baseline_flakes"):
        notes.append(
            f"Baseline runs that crashed and were retried: {len(result['baseline_flakes'])} "
            f"({result['baseline_flakes'][0]})."
        )
    errors = [
        f"{name} at world {r['world_size']}: {r[name]['error']}"
        for r in rows
        for name in (*TIERS, "gloo_rebuilt", *BASELINES)
        if isinstance(r.get(name), dict) and "error" in r[name]
    ]
    notes += [f"¹ {e}" for e in errors]
    ratio_title = "Ratio (baseline ÷ meshsim tier, same run):"
    return "\n\n".join([md_table(head, body), ratio_title, md_table(ratios_head, ratios), *notes])


def main() -> None:
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
