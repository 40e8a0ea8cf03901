"""Section 4: sweep throughput, layouts verified per second, per tier, at world 8 and 16.

A fixed sample of ``meshsim.layouts(world)`` (every convention, ``PER_FRAMEWORK`` cases of each,
evenly spaced through that convention's list, so the sample is the same on every run) goes
through ``meshsim.verify.verify_many(cases, backend)``: reference, live build with meshsim's
plain-torch builder on every rank, diff. The gloo pool is booted (and timed) before the sweep,
so the throughput is the steady state of a long sweep; the boot is reported beside it.

    python benchmarks/sweep_throughput.py [--quick] [--json out.json]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _common import fmt_s, loadavg, md_table, section_main

TIERS = ("fake", "threaded", "gloo")


def sample_cases(world: int, per_framework: int) -> list[Any]:
    import meshsim

    cases = meshsim.layouts(world)
    by_framework: dict[str, list[Any]] = {}
    for case in cases:
        by_framework.setdefault(case.framework, []).append(case)
    picked = []
    for group in by_framework.values():
        step = max(1, len(group) // per_framework)
        picked += group[::step][:per_framework]
    return picked


def run(quick: bool) -> dict[str, Any]:
    from meshsim.harness import shutdown
    from meshsim.verify import verify_many

    per_framework = 2 if quick else 6
    rounds = 1 if quick else 2
    rows = []
    for world in (8, 16):
        cases = sample_cases(world, per_framework)
        row: dict[str, Any] = {
            "world_size": world,
            "cases": len(cases),
            "case_ids": [c.id for c in cases],
            "load_average": loadavg(),
        }
        for tier in TIERS:
            entry: dict[str, Any] = {}
            if tier == "gloo":
                shutdown()
                start = time.perf_counter()
                list(verify_many(cases[:1], tier))  # boots `world` workers
                entry["pool_boot_and_first_case_s"] = time.perf_counter() - start
            else:
                list(verify_many(cases[:1], tier))  # first-use imports
            walls, failed = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                results = list(verify_many(cases, tier))
                walls.append(time.perf_counter() - start)
                failed = [str(r).splitlines()[0] for r in results if not r.passed]
            wall = statistics.median(walls)
            entry.update(
                {
                    "median_s": wall,
                    "samples_s": walls,
                    "layouts_per_s": len(cases) / wall,
                    "s_per_layout": wall / len(cases),
                    "failed": failed,
                }
            )
            row[tier] = entry
        rows.append(row)
    shutdown()
    return {"rows": rows, "per_framework": per_framework, "rounds": rounds}


def render(result: dict[str, Any]) -> str:
    head = ["world", "cases"]
    head += [f"{t} layouts/s" for t in TIERS] + ["gloo pool boot + first case"]
    body = []
    failures = []
    for r in result["rows"]:
        line = [str(r["world_size"]), str(r["cases"])]
        for t in TIERS:
            e = r[t]
            line.append(f"{e['layouts_per_s']:.1f} ({fmt_s(e['s_per_layout'])}/layout)")
            failures += [f"{t} world {r['world_size']}: {f}" for f in e["failed"]]
        line.append(fmt_s(r["gloo"].get("pool_boot_and_first_case_s")))
        body.append(line)
    notes = [
        f"`verify_many` over a fixed sample: {result['per_framework']} cases of each of the 6 "
        "conventions, evenly spaced through `meshsim.layouts(world)`; median of "
        f"{result['rounds']} sweep(s). Fake batches up to 32 cases per harness run; threaded and "
        "gloo run one harness call per case (warm pool)."
    ]
    notes.append("All cases passed." if not failures else "Failures: " + "; ".join(failures[:5]))
    return "\n\n".join([md_table(head, body), *notes])


def main() -> None:
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
