"""Live counts for the closing note: for every config ``meshsim.layouts(N, fw)`` lists, build it
with the real framework on gloo, diff every kind, and reproduce the listed rejections.

Run: ``python benchmarks/live_counts.py deepspeed 8`` (on demand; minutes per framework; any
framework with a real adapter; refusals are ``meshsim.refused_configs(N, framework)``). A fourth
argument keeps only the layouts whose id contains it: ``megatron 16 gloo hyper_comm_grid``.
``--shard I/N`` runs every N-th layout and refusal from the I-th, to spread a run over cores.
Prints one JSON line: layouts, kinds compared, kinds equal, rejections tried / reproduced, time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from _common import take_shard  # also puts this checkout first on sys.path (tests.real)

import meshsim
from meshsim.builders.real import REAL_BUILDERS, outside_adapter
from meshsim.checks import ObservedLayout, diff
from meshsim.errors import LayoutError


def _refusals(framework: str, world: int) -> list[dict[str, Any]]:
    """The convention's own refusals (``meshsim.refused_configs``)."""
    return [case.config for case in meshsim.refused_configs(world, framework)]


def main(
    framework: str, world: int, backend: str = "gloo", match: str = "", shard: str = "0/1"
) -> dict[str, Any]:
    """Counts over the layouts whose id contains ``match`` (all by default) and every refusal,
    or, with ``shard="I/N"``, every N-th of each from the I-th (one run per core; sum them)."""
    from tests.real._helpers import adapter, real_outcomes

    start = time.perf_counter()
    compared = equal = layouts = 0
    mismatched: list[str] = []
    for case in take_shard(meshsim.layouts(world, framework), shard):
        if match not in case.id or outside_adapter(framework, case.config):
            continue  # another line or release than the installed one: sweep --real skips it too
        layouts += 1
        expected = meshsim.expect(framework, world, **case.config)
        names = set(expected.kinds()) | set(expected.unavailable())
        try:
            observed = meshsim.run(
                adapter(framework).build,
                world,
                backend=backend,
                timeout=300,
                args=(world, dict(case.config)),
            )
        except Exception as error:  # one failed layout (a timeout under load) is counted, not fatal
            compared += len(names)
            mismatched.append(f"{case.id}: {type(error).__name__}")
            print(f"{layouts} {case.id}: {type(error).__name__}", file=sys.stderr, flush=True)
            continue
        print(f"{layouts} {case.id}", file=sys.stderr, flush=True)
        seen = set(ObservedLayout.of(list(observed)).names())
        for kind in sorted(names):
            compared += 1
            if kind in seen and diff(list(observed), expected, kinds=[kind]) is None:
                equal += 1
            else:
                mismatched.append(f"{case.id}:{kind}")
    refusals = [
        c
        for c in take_shard(_refusals(framework, world), shard)
        if not outside_adapter(framework, c)
    ]
    reproduced = 0
    for config in refusals:
        with_upstream = None
        try:
            meshsim.expect(framework, world, **config)
        except LayoutError as error:
            with_upstream = error.upstream
        outcomes = real_outcomes(framework, world, config) if backend == "gloo" else []
        if outcomes and all(o[0] == "refused" and o[2] == with_upstream for o in outcomes):
            reproduced += 1
    return {
        "framework": framework,
        "world": world,
        "backend": backend,
        "match": match,
        "shard": shard,
        "layouts": layouts,
        "kinds_compared": compared,
        "kinds_equal": equal,
        "mismatched": mismatched[:20],
        "rejections": len(refusals),
        "rejections_reproduced": reproduced,
        "seconds": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=sorted(REAL_BUILDERS))
    parser.add_argument("world", type=int)
    parser.add_argument("backend", nargs="?", default="gloo")
    parser.add_argument("match", nargs="?", default="", help="keep layouts whose id contains it")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th layout from the I-th")
    args = parser.parse_args()
    counts = main(args.framework, args.world, args.backend, args.match, args.shard)
    print(json.dumps(counts), flush=True)
