"""``meshsim sweep`` end to end at the sizes users ask for, each a fresh process, wall time.

* world 8, every framework, the main job's sweep (``--communicate 4``): distinct group
  structures proven once (the default) against ``--exhaustive`` (every layout on every rank),
  interleaved;
* world 1,024: the reference step alone, megatron, torchtitan, and every framework;
* world 64, megatron on fake: the size and estimate the sweep prints, and its rate over a
  ``--budget`` (the whole run takes longer than a benchmark should).

    python benchmarks/sweep_scale.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, job_free_env


def sweep(*args: str) -> dict[str, object]:
    """One ``python -m meshsim sweep ARGS --json F``: wall seconds and the report's counts."""
    out = ROOT / "benchmarks" / "results" / f".sweep-scale-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = job_free_env()
    command = [sys.executable, "-m", "meshsim", "sweep", *args, "--json", str(out)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    try:
        data = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    if done.returncode not in (0,):
        raise SystemExit(f"sweep {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    estimate = re.search(r"about (.+) estimated", done.stderr)
    return {
        "args": " ".join(args),
        "wall_s": round(wall, 1),
        "load_1min": round(load, 2),
        "layouts": data["layouts_total"],
        "built": data["layouts_built"],
        "structures": data["distinct_group_structures"],
        "estimate": estimate.group(1) if estimate else None,
        "budget_spent": data["budget_spent"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, megatron at 1,024")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    rounds = 1 if args.quick else 2
    for _ in range(rounds):  # interleaved: the load drifts
        rows.append(sweep("-n", "8", "--communicate", "4"))
        rows.append(sweep("-n", "8", "--communicate", "4", "--exhaustive"))
    frameworks = [["--framework", "megatron"]]
    if not args.quick:
        frameworks += [["--framework", "torchtitan"], []]
    for chosen in frameworks:
        rows.append(sweep("-n", "1024", *chosen))
    rows.append(sweep("-n", "64", "--framework", "megatron", "--backend", "fake", "--budget", "60"))
    for row in rows:
        print(json.dumps(row), flush=True)
    print("\n| sweep | layouts | distinct structures | built | wall | estimate printed | load |")
    print("| :-- | --: | --: | --: | --: | :-- | --: |")
    for row in rows:
        print(
            f"| `{row['args']}` | {row['layouts']:,} | {row['structures']:,} | "
            f"{row['built']:,} | {row['wall_s']} s | {row['estimate'] or '—'} | "
            f"{row['load_1min']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
