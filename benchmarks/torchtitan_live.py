"""Every torchtitan 0.3.0 layout at one world size, checked live against the reference; counts.

Runs torchtitan's own ``ParallelDims`` (``meshsim verify torchtitan --real``) for every layout
``meshsim.layouts(N, "torchtitan", versions=["current"], spmd_backends=<all three>)`` lists, and
for every config ``refused_configs(N)`` lists, and prints one JSON line of counts: layouts,
kinds compared (summed over layouts), kinds equal, rejections reproduced (same exception type
as the reference names), failures, and the wall time. Run on demand (minutes), e.g.::

    python benchmarks/torchtitan_live.py --world 8 --backend gloo
    python benchmarks/torchtitan_live.py --world 16 --backend fake
    python benchmarks/torchtitan_live.py --world 16 --backend fake --shard 1/2   # and 0/2
    python benchmarks/torchtitan_live.py --world 16 --backend gloo --sample 24
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _common import take_shard

from meshsim import layouts
from meshsim.model.conventions._torchtitan_api import refused_configs
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many

BACKENDS = ["spmd_types", "partial_dtensor", "full_dtensor"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "fake", "threaded"])
    parser.add_argument(
        "--sample", type=int, default=0, help="N evenly spaced layouts and refusals (0: all)"
    )
    parser.add_argument(
        "--shard",
        default="0/1",
        help="I/N: only every N-th layout and refusal from the I-th, to spread a run over cores "
        "(sum the N JSON lines)",
    )
    args = parser.parse_args(argv)
    valid = layouts(args.world, "torchtitan", versions=["current"], spmd_backends=BACKENDS)
    refused = [
        LayoutCase("torchtitan", args.world, {"version": "current", **c})
        for c in refused_configs(args.world)
    ]
    if args.sample:
        valid, refused = _spread(valid, args.sample), _spread(refused, args.sample)
    valid, refused = take_shard(valid, args.shard), take_shard(refused, args.shard)
    counts = {"world": args.world, "backend": args.backend, "shard": args.shard}
    counts["layouts"] = len(valid)
    counts.update(kinds_compared=0, kinds_equal=0, layouts_equal=0)
    counts.update(refused=len(refused), rejections_reproduced=0, failures=[])
    start = time.perf_counter()
    for result in verify_many([*valid, *refused], args.backend, real=True, timeout=300):
        if result.rejected:
            counts["rejections_reproduced"] += 1
            continue
        if not result.passed:
            counts["failures"].append(f"{dict(result.config)}: {str(result)[:400]}")
        checked = len(result.kinds_checked)
        wrong = {m.kind for m in result.diff.mismatches} if result.diff else set()
        counts["kinds_compared"] += checked
        counts["kinds_equal"] += checked - len(wrong)
        counts["layouts_equal"] += int(result.passed)
        done = counts["layouts_equal"] + counts["rejections_reproduced"] + len(counts["failures"])
        if done % 25 == 0:  # progress on stderr, so a run cut short still reports its counts
            print(json.dumps({**counts, "seconds": round(time.perf_counter() - start, 1)}),
                  file=sys.stderr, flush=True)  # fmt: skip
    counts["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(counts))
    return 0 if not counts["failures"] else 1


def _spread(cases: list[LayoutCase], count: int) -> list[LayoutCase]:
    step = max(1, len(cases) // count)
    return cases[::step][:count]


if __name__ == "__main__":
    sys.exit(main())
