"""Section 6: gloo pool boot, workers forked from a template vs one fresh interpreter each.

Boot = from a cold pool (``shutdown()``) to every one of ``world`` workers reporting ready
(``Pool.acquire``), measured both ways interleaved: ``template`` (the default: one process
imports torch, workers are forked from it) and ``spawn`` (``MESHSIM_POOL_BOOT=spawn``: each
worker is a fresh interpreter importing torch). Wall time and the CPU time of this process,
its children and the live pool (template and workers, from /proc) are reported.

    python benchmarks/pool_boot.py [--quick] [--json out.json]
"""

from __future__ import annotations

import functools
import os
from typing import Any

from _common import (
    cell,
    fmt_ratio,
    interleaved,
    loadavg,
    md_table,
    ratio,
    section_main,
)

WORLDS = (8, 16)
MODES = ("template", "spawn")


def boot(world: int, mode: str) -> None:
    """Cold pool to ``world`` ready workers; the pool is shut down again before the next one."""
    from meshsim.harness import pool

    pool.shutdown()
    pool.BOOT_MODE = mode
    pool.POOL_SIZE = world
    try:
        workers = pool.get_pool().acquire(world)
        pool.get_pool().release(workers, [])
    finally:
        pool.BOOT_MODE = "template"


def run(quick: bool) -> dict[str, Any]:
    from meshsim.harness import pool

    rounds = 2 if quick else 5
    rows = []
    for world in WORLDS:
        variants = {m: functools.partial(boot, world, m) for m in MODES}
        row = {"world_size": world, "load_average": loadavg()}
        row.update(interleaved(variants, rounds, warmup=False))
        rows.append(row)
    pool.shutdown()
    return {"rows": rows, "rounds": rounds}


def render(result: dict[str, Any]) -> str:
    head = [
        "world",
        "template (fork after one import)",
        "spawn per worker (before)",
        "spawn ÷ template",
    ]
    body = [
        [
            str(r["world_size"]),
            cell(r.get("template")),
            cell(r.get("spawn")),
            fmt_ratio(ratio(r.get("spawn"), r.get("template"))),
        ]
        for r in result["rows"]
    ]
    notes = (
        "Cold pool to every worker ready; median wall time, CPU of all processes in brackets, "
        f"n={result['rounds']} each, interleaved. Load average (1 min) per world: "
        + ", ".join(f"{r['world_size']}: {r['load_average'][0]:.1f}" for r in result["rows"])
        + f" on {os.cpu_count()} cores."
    )
    return md_table(head, body) + "\n\n" + notes


def main() -> None:
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
