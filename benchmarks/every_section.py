"""Every section of ``docs/performance.md``, one command after another, at one commit.

The sections' own commands, in the document's order, each in a fresh process with nothing of
ours running beside it: what each printed goes to ``benchmarks/results/every-<time>/`` (one
``.txt`` per command), with a summary of the commit, the load average at each start and each
wall time (``summary.json``). About 30 minutes on 2 cores. The document's tables are copied
from those files; run it on a quiet machine, and say so where it was not.

    python benchmarks/every_section.py [--only NAME,...] [--list]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import ROOT, job_free_env, loadavg, machine, machine_line

#: (name, sections, command): the commands ``docs/performance.md`` names, in its order.
COMMANDS = (
    ("run_quick", "1, 2, 4 (per layout), 5, 6", ["run.py", "--quick"]),
    ("gloo_churn", "1.1", ["gloo_churn.py"]),
    ("fake_scale", "3", ["fake_scale.py", "--worlds", "1024"]),
    ("sweep_scale", "4 (whole sweeps)", ["sweep_scale.py"]),
    ("cli_output", "7", ["cli_output.py"]),
    ("bench_usage", "8.1", ["bench_usage.py", "--repeat", "5"]),
    ("local_tensor", "8.2", ["local_tensor.py"]),
    ("plugin_suite", "9", ["plugin_suite.py", "--repeat", "3"]),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args()
    chosen = COMMANDS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _, _ in COMMANDS}
        if unknown:
            parser.error(f"unknown names {sorted(unknown)}; see --list")
        chosen = tuple(c for c in COMMANDS if c[0] in wanted)
    if args.list:
        for name, sections, command in chosen:
            print(f"{name:<13} section {sections}: python benchmarks/{' '.join(command)}")
        return 0
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    out = ROOT / "benchmarks" / "results" / time.strftime("every-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    summary: dict[str, object] = {"commit": commit, "machine": machine_line(machine()), "runs": []}
    print(f"meshsim {commit}; results in {out}", flush=True)
    failed = 0
    for name, sections, command in chosen:
        load = loadavg()[:1]
        start = time.perf_counter()
        with open(out / f"{name}.txt", "w") as log:
            code = subprocess.run(
                [sys.executable, str(ROOT / "benchmarks" / command[0]), *command[1:]],
                cwd=ROOT / "benchmarks",
                stdout=log,
                stderr=subprocess.STDOUT,
                env=job_free_env(),
            ).returncode
        wall = round(time.perf_counter() - start, 1)
        failed += code != 0
        run = {"name": name, "sections": sections, "command": command, "exit": code}
        run |= {"load_1min_at_start": load[0] if load else None, "wall_s": wall}
        summary["runs"].append(run)  # type: ignore[attr-defined]
        print(json.dumps(run), flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
