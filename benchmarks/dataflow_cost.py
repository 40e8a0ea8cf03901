"""Per-check cost at world 8: the data-flow recipe next to the plain group check (verify).

    python benchmarks/dataflow_cost.py [--repeat 3] [--backends threaded gloo]

Each timing is the wall time of one call from the caller's side, median of ``--repeat``, after
one warm-up call per tier (the gloo pool starts there). Prints the load average, which matters
on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from meshsim.dataflow.recipes import check_dataflow
from meshsim.verify import verify

LAYOUTS = {
    "olmo-core": {"dp": "fsdp", "cp": 2, "tp": 2},
    "torchtitan": {"dp_shard": 2, "cp": 2, "tp": 2},
}


def _time(fn, repeat: int, *args, **config) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args, **config)
        samples.append(time.perf_counter() - start)
        assert result.passed, str(result)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["threaded", "gloo"])
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    print("| framework | tier | group check (verify) | data-flow check | ratio |")
    print("| :-- | :-- | --: | --: | --: |")
    for backend in args.backends:
        for framework, config in LAYOUTS.items():
            verify(framework, 8, backend, **config)  # warm-up (pool start, imports)
            check_dataflow(framework, 8, backend, **config)
            plain = _time(verify, args.repeat, framework, 8, backend, **config)
            flow = _time(check_dataflow, args.repeat, framework, 8, backend, **config)
            print(
                f"| {framework} | {backend} | {plain * 1000:.0f} ms | {flow * 1000:.0f} ms | "
                f"{flow / plain:.1f}x |"
            )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
