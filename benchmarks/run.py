"""meshsim benchmarks, side by side with the tools people use today: one entry point.

    python benchmarks/run.py [--quick] [--json out.json] [--markdown out.md]
                             [--only per_test,scaling,fake_scale,sweep,memory,pool_boot]
                             [--what-if]

Sections (each runs in its own fresh process, so a gloo pool, a threaded world or a peak RSS
never leaks from one into the next):

1. ``per_test``   per-test cost of one layout test at world 2, 4, 8: meshsim fake / threaded /
                  gloo (warm pool) vs spawn-per-test and fork-per-test baselines (per_test_cost.py)
2. ``scaling``    reference model, 2^10..2^20 ranks, vs megatron-core RankGenerator and
                  DeepSpeed ProcessTopology (scaling_vs_frameworks.py)
3. ``fake_scale`` the fake tier: every rank of a real DeviceMesh at world 1,024; 64 sampled ranks
                  at world 131,072 (fake_scale.py; ``--what-if`` adds the measured fixes)
4. ``sweep``      layouts verified per second per tier at world 8 and 16 (sweep_throughput.py)
5. ``memory``     peak RSS of the harness parent and of each worker at world 8 and 64 (memory.py)
6. ``pool_boot``  gloo pool boot at world 8 and 16: workers forked from a template that imported
                  torch once vs a fresh interpreter per worker (pool_boot.py)

It prints markdown (machine, command, one table per section) and writes every number, with
its samples and the load average, to ``--json``. Not part of the test suite (pytest collects
``tests/`` only). ``--quick`` takes a few minutes on 2 cores; the full run takes longer (the
framework columns at 2^20 ranks alone take minutes: they are pure-Python loops).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import dump, fmt_s, loadavg, machine, machine_line  # noqa: E402

SECTIONS = {
    "per_test": ("per_test_cost", "1. Per-test cost of verifying one layout"),
    "scaling": ("scaling_vs_frameworks", "2. Reference model vs the frameworks' rank generators"),
    "fake_scale": ("fake_scale", "3. Fake tier at scale"),
    "sweep": ("sweep_throughput", "4. Sweep throughput"),
    "memory": ("memory", "5. Memory"),
    "pool_boot": ("pool_boot", "6. gloo pool boot"),
}


def run_section(name: str, quick: bool, what_if: bool) -> dict[str, Any]:
    module, _ = SECTIONS[name]
    with tempfile.TemporaryDirectory(prefix="meshsim-bench-") as tmp:
        out = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, str(HERE / f"{module}.py"), "--json", str(out)]
        if quick:
            cmd.append("--quick")
        if what_if and name == "fake_scale":
            cmd.append("--what-if")
        env = dict(os.environ, PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            error = f"exit code {done.returncode}"
            return {"error": error, "output_tail": tail, "seconds": seconds}
        result = json.loads(out.read_text())
    result["seconds"] = seconds
    return result


def render_section(name: str, result: dict[str, Any]) -> str:
    module, title = SECTIONS[name]
    head = f"### {title}\n\n"
    if "error" in result:
        return head + f"Failed ({result['error']}):\n\n```\n{result['output_tail']}\n```"
    text = importlib.import_module(module).render(result)
    return head + text + f"\n\n(section time: {fmt_s(result['seconds'])})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="meshsim benchmarks beside spawn/fork-per-test and the frameworks' generators"
    )
    parser.add_argument("--quick", action="store_true", help="a few minutes: fewer repetitions")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--markdown", help="also write the tables here")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="fake_scale: also measure the harness fixes (on by default in full mode)",
    )
    args = parser.parse_args()
    names = list(SECTIONS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    what_if = args.what_if or not args.quick
    info = machine()
    command = "python benchmarks/run.py"
    command += " --quick" if args.quick else ""
    command += f" --only {args.only}" if args.only else ""
    command += " --what-if" if args.what_if else ""
    total = time.perf_counter()
    results: dict[str, Any] = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} (load {loadavg()}) ...", file=sys.stderr, flush=True)
        results[name] = run_section(name, args.quick, what_if)
        print(f"      done in {fmt_s(results[name]['seconds'])}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - total
    doc = [
        f"Measured with `{command.strip()}` ({'quick' if args.quick else 'full'} mode, "
        f"{fmt_s(seconds)} in all) on: {machine_line(info)}. Load average at the end: "
        f"{' / '.join(f'{x:.2f}' for x in loadavg())}.",
    ]
    doc += [render_section(name, results[name]) for name in names]
    text = "\n\n".join(doc)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        dump(
            args.json,
            {
                "machine": info,
                "command": command.strip(),
                "mode": "quick" if args.quick else "full",
                "seconds": seconds,
                "load_average_end": loadavg(),
                "sections": results,
            },
        )


if __name__ == "__main__":
    main()
