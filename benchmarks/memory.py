"""Section 5: peak memory of the harness parent and of each worker, at world 8 and 64.

Each (tier, world) runs in a fresh process (``--probe TIER WORLD``) so that its peak is its own:
it runs the per-test work of ``_baselines`` once through ``meshsim.run``, then reports its own
``VmHWM`` (peak resident set) and, for the gloo tier, every pool worker's ``VmHWM`` read from
``/proc/<pid>/status`` (the workers are found with ``meshsim.harness.pool.pool_pids()`` and
cross-checked against ``/proc/<parent>/task/*/children``). ``VmHWM`` counts shared pages (the
torch libraries) in full in every process; ``Pss`` (from ``/proc/<pid>/smaps_rollup``) splits
them between the processes that share them, so the sum of ``Pss`` is what the machine pays.

gloo at world 64 needs 64 worker processes, each with torch imported: before starting it the
parent projects the cost from world 8 (64 x the mean worker Pss) and skips it, or falls back to
the largest world that fits in half of MemAvailable, saying so.

    python benchmarks/memory.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    children,
    fmt_mib,
    fmt_s,
    loadavg,
    md_table,
    meminfo_gib,
    section_main,
    vm_status,
)

HERE = Path(__file__).resolve().parent


def pss_kib(pid: int | str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File", "Rss"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def probe(tier: str, world: int) -> dict[str, Any]:
    """Runs in the fresh process: one test through meshsim.run, then read the peaks."""
    sys.path.insert(0, str(HERE))
    import _baselines as base

    from meshsim.harness import pool, run

    before = vm_status()
    start = time.perf_counter()
    values = run(base.harness_body, world, tier, timeout=900, args=(world,))
    seconds = time.perf_counter() - start
    for rank, got in enumerate(values):
        base.check(world, rank, got, real=tier != "fake")
    out: dict[str, Any] = {
        "tier": tier,
        "world_size": world,
        "seconds": seconds,
        "parent_before_run": before,
        "parent": {**vm_status(), **pss_kib("self")},
    }
    if tier == "gloo":
        pids = pool.pool_pids()
        kids = set(children())
        out["workers_found_in_proc_children"] = sorted(set(pids) & kids) == sorted(pids)
        out["workers"] = [{"pid": p, **vm_status(p), **pss_kib(p)} for p in pids]
    return out


def _run_probe(tier: str, world: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", tier, str(world)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"tier": tier, "world_size": world, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"tier": tier, "world_size": world, "error": f"rc={done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _worker_stats(res: dict[str, Any]) -> dict[str, Any]:
    workers = res.get("workers") or []
    if not workers:
        return {}
    hwm = [w.get("VmHWM", 0) for w in workers]
    pss = [w.get("Pss", 0) for w in workers]
    return {
        "count": len(workers),
        "vmhwm_median_kib": statistics.median(hwm),
        "vmhwm_max_kib": max(hwm),
        "pss_mean_kib": statistics.mean(pss),
        "pss_sum_kib": sum(pss),
    }


def run(quick: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    timeout = 600.0 if quick else 1800.0
    for tier in ("fake", "threaded"):
        for world in (8, 64):
            rows.append(_run_probe(tier, world, timeout))
    gloo8 = _run_probe("gloo", 8, timeout)
    rows.append(gloo8)
    stats8 = _worker_stats(gloo8)
    if not stats8:
        skipped.append("gloo world 64: world 8 gave no worker numbers to project from")
    else:
        per_worker = stats8["pss_mean_kib"]
        available = (meminfo_gib("MemAvailable") or 0) * 2**20
        fits = int(available * 0.5 // per_worker) if per_worker else 0
        need64 = 64 * per_worker
        projection = (
            f"projected {fmt_mib(need64)} for 64 workers (64 x {fmt_mib(per_worker)} Pss each) "
            f"vs {fmt_mib(available)} MemAvailable now"
        )
        if quick:
            skipped.append(f"gloo world 64: skipped in --quick ({projection})")
        elif need64 <= available * 0.5:
            rows.append(_run_probe("gloo", 64, timeout))
        else:
            world = 32 if fits >= 32 else 16 if fits >= 16 else 0
            skipped.append(
                f"gloo world 64: not run, {projection}; it would not fit in half of it"
                + (f"; measured world {world} instead" if world else "")
            )
            if world:
                rows.append(_run_probe("gloo", world, timeout))
    return {"rows": rows, "skipped": skipped, "load_average_end": loadavg()}


def render(result: dict[str, Any]) -> str:
    head = [
        "tier",
        "world",
        "parent peak (VmHWM)",
        "workers",
        "worker peak VmHWM (median / max)",
        "worker Pss (mean)",
        "all workers Pss (sum)",
        "run time",
    ]
    body = []
    notes = []
    for r in result["rows"]:
        if "error" in r:
            body.append([r["tier"], str(r["world_size"]), "error¹", "", "", "", "", ""])
            notes.append(f"¹ {r['tier']} world {r['world_size']}: {r['error']}")
            continue
        s = _worker_stats(r)
        body.append(
            [
                r["tier"],
                str(r["world_size"]),
                fmt_mib(r["parent"].get("VmHWM")),
                str(s.get("count", "— (in-process)")),
                f"{fmt_mib(s['vmhwm_median_kib'])} / {fmt_mib(s['vmhwm_max_kib'])}" if s else "—",
                fmt_mib(s.get("pss_mean_kib")) if s else "—",
                fmt_mib(s.get("pss_sum_kib")) if s else "—",
                fmt_s(r.get("seconds")),
            ]
        )
    text = md_table(head, body)
    text += (
        "\n\nOne test (`_baselines.mesh_work`) per fresh process. VmHWM counts the shared torch "
        "libraries in every process; Pss shares them out, so the Pss sum is what the machine "
        "pays for the workers. A spawn-per-test child is a fresh interpreter that imports torch, "
        "like a gloo worker."
    )
    notes += result.get("skipped", [])
    return "\n\n".join([text, *notes])


def main() -> None:
    # The hidden ``--probe TIER WORLD`` is how run() measures one tier in a child process.
    hidden = argparse.ArgumentParser(add_help=False)
    hidden.add_argument("--probe", nargs=2, metavar=("TIER", "WORLD"))
    known, _ = hidden.parse_known_args()
    if known.probe:
        os.environ.setdefault("MESHSIM_MAX_WORLD_SIZE", "64")
        print(json.dumps(probe(known.probe[0], int(known.probe[1]))))
        return
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
