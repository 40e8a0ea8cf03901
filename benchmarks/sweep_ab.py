"""Two commits' ``meshsim sweep`` side by side: wall, peak memory, and whether results agree.

Each commit is checked out in a temporary git worktree; each sweep runs in a fresh process
from its worktree, alternating the two commits round by round (a burst of load hits both).
After each pair, every field of every result (``seconds`` aside) is compared: a speed-up
that changes an answer is a bug, and this says which layout and which field.

    python benchmarks/sweep_ab.py BEFORE AFTER [--rounds 2] [--json out.json] [-- SWEEP ARGS]

Default sweep arguments: the three world-1,024 reference sweeps of performance.md section 4
(every convention, megatron, torchtitan). Example, one sweep::

    python benchmarks/sweep_ab.py afa0307 HEAD -- -n 64 --backend reference
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, job_free_env

DEFAULT_SWEEPS = (
    ("-n", "1024"),
    ("-n", "1024", "--framework", "megatron"),
    ("-n", "1024", "--framework", "torchtitan"),
)


#: Runs the sweep as its only child, then prints the largest resident set any process of it
#: had (``ru_maxrss`` of waited children: the sweep or one of its workers).
_MEASURED = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
    "file=sys.stderr); sys.exit(code)"
)


def run_sweep(tree: Path, args: tuple[str, ...], report: Path) -> dict[str, Any]:
    """One ``python -m meshsim sweep ARGS --json REPORT`` in ``tree``: wall, peak RSS, load."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED,
         sys.executable, "-m", "meshsim", "sweep", *args, "--json", str(report)],
        cwd=tree, capture_output=True, text=True, env=job_free_env(),
    )  # fmt: skip
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: a layout failed, which the comparison shows
        raise SystemExit(f"sweep {' '.join(args)} in {tree} exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")  # fmt: skip
    peak = int(done.stderr.rsplit("peak_kib", 1)[1].split()[0])
    return {"wall_s": round(wall, 2), "peak_mib": round(peak / 1024), "load_1min": round(load, 2)}


def differences(before: Path, after: Path, shown: int = 3) -> list[str]:
    """Fields that differ between two sweep reports, ``seconds`` aside (at most ``shown``)."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    found = [f"top-level {k}" for k in a if k not in ("results", "seconds", "summary")
             and a[k] != b.get(k)]  # fmt: skip
    if len(a["results"]) != len(b["results"]):
        return [*found, f"{len(a['results'])} results against {len(b['results'])}"]
    for x, y in zip(a["results"], b["results"]):
        x, y = _timeless(x), _timeless(y)
        found += [f"{x.get('id')}: {k}" for k in x if x[k] != y.get(k)]
        if len(found) >= shown:
            break
    return found[:shown]


def _timeless(result: dict[str, Any]) -> dict[str, Any]:
    tiers = {t: {k: v for k, v in r.items() if k != "seconds"}
             for t, r in (result.get("tiers") or {}).items()}  # fmt: skip
    return {**result, "tiers": tiers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    extra = tuple(argv[cut + 1 :])  # the sweep's own arguments, after "--"
    sweeps = [extra] if extra else list(DEFAULT_SWEEPS)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="meshsim-sweep-ab-") as scratch:
        trees = {side: Path(scratch) / side for side in ("before", "after")}
        for side, tree in trees.items():
            rev = getattr(args, side)
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev],
                           cwd=ROOT, check=True)  # fmt: skip
        try:
            for number in range(args.rounds):
                for sweep in sweeps:
                    reports = {side: Path(scratch) / f"{side}.json" for side in trees}
                    for side in ("before", "after") if number % 2 == 0 else ("after", "before"):
                        row = run_sweep(trees[side], sweep, reports[side])
                        rows.append({"round": number + 1, "side": side,
                                     "args": " ".join(sweep), **row})  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
                    differ = differences(reports["before"], reports["after"])
                    rows.append({"round": number + 1, "args": " ".join(sweep), "differ": differ})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if any(row.get("differ") for row in rows):
        raise SystemExit("the two commits' results differ (see the 'differ' rows)")


if __name__ == "__main__":
    main()
