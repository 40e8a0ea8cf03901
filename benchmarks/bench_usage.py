"""What the serial comparison costs at world 8, next to the group check, on both tiers.

    python benchmarks/bench_usage.py [--repeat 3] [--backends threaded gloo] [--out DIR]

Three checks of one layout, each timed from the caller's side:

- ``verify("olmo-core", 8, dp="fsdp", cp=2, tp=2)``: the group check (are the groups right);
- ``check_equivalence`` of the same layout: the data-flow recipe's training step (FSDP2 over
  olmo-core's gradient mesh, DTensor TP) under ``assert_matches_serial`` (are they used right);
- ``assert_matches_serial`` of ``tests/usage/toy.py``'s ``dense_step`` (explicit collectives on
  plain tensors, torch mesh (dp, cp, tp) = (2, 2, 2)).

For the two serial comparisons the wall time is split into the N-rank run and the serial twin
(``Equivalence.seconds`` / ``serial_seconds``); CPU time counts this process, its children and
the gloo pool's workers. The recipe's split comes from calling
``assert_matches_serial`` with the recipe's own step, as ``check_equivalence`` does. Every
variant runs once untimed first (the gloo pool starts there), then ``--repeat`` rounds,
interleaved; medians are reported with the load average, which matters on a shared machine.
Writes ``usage-<time>.json`` and ``.md`` under ``--out`` (``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    cpu_now,
    dump,
    fmt_ratio,
    fmt_s,
    loadavg,
    machine,
    machine_line,
    md_table,
)

LAYOUT = {"dp": "fsdp", "cp": 2, "tp": 2}
DENSE = {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp", "cp", "tp")}
WORLD = 8

#: One timed call: (wall seconds, N-rank seconds or None, serial-twin seconds or None).
Sample = tuple[float, float | None, float | None]


def _group_check(backend: str) -> Sample:
    from meshsim.verify import verify

    start = time.perf_counter()
    result = verify("olmo-core", WORLD, backend, **LAYOUT)
    wall = time.perf_counter() - start
    if not result.passed:
        raise RuntimeError(str(result))
    return wall, None, None


def _recipe(backend: str) -> Sample:
    from meshsim.usage.recipe import check_equivalence

    start = time.perf_counter()
    result = check_equivalence("olmo-core", WORLD, backend, **LAYOUT)
    wall = time.perf_counter() - start
    if not result.passed:
        raise RuntimeError(str(result))
    return wall, None, None


def _recipe_split(backend: str) -> Sample:
    """The recipe's step under ``assert_matches_serial`` directly, for the N-rank / serial
    split (``check_equivalence`` keeps only a summary line)."""
    from meshsim.model.conventions import expect
    from meshsim.usage import recipe
    from meshsim.usage.serial import assert_matches_serial

    expected = expect("olmo-core", WORLD, **LAYOUT)
    stages, data = recipe._size(expected, "pipeline"), recipe._size(expected, "data_parallel")
    step = functools.partial(recipe._train, "olmo-core", LAYOUT, False, "correct", stages, data)
    start = time.perf_counter()
    result = assert_matches_serial(step, WORLD, expected, backend=backend)
    return time.perf_counter() - start, result.seconds, result.serial_seconds


def _toy(backend: str) -> Sample:
    from meshsim.usage.serial import assert_matches_serial
    from tests.usage import toy

    start = time.perf_counter()
    result = assert_matches_serial(
        toy.dense_step, WORLD, "torch", backend=backend, batch=toy.dense_batch, **DENSE
    )
    return time.perf_counter() - start, result.seconds, result.serial_seconds


CHECKS: dict[str, Callable[[str], Sample]] = {
    "group check (verify)": _group_check,
    "recipe equivalence (check_equivalence)": _recipe,
    "recipe step, split": _recipe_split,
    "toy dense_step (assert_matches_serial)": _toy,
}


def measure(backend: str, repeat: int) -> dict[str, Any]:
    """Every check once untimed, then ``repeat`` interleaved rounds; medians per part."""
    for check in CHECKS.values():
        check(backend)
    samples: dict[str, list[Sample]] = {name: [] for name in CHECKS}
    cpus: dict[str, list[float]] = {name: [] for name in CHECKS}
    names = list(CHECKS)
    load = [loadavg()[:1]]
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cpu = cpu_now()
            samples[name].append(CHECKS[name](backend))
            cpus[name].append(cpu_now() - cpu)
        load.append(loadavg()[:1])
    out: dict[str, Any] = {"load_average_1min": [x[0] for x in load if x]}
    for name, taken in samples.items():
        walls = [s[0] for s in taken]
        row: dict[str, Any] = {
            "median_s": statistics.median(walls),
            "cpu_median_s": statistics.median(cpus[name]),
            "samples_s": walls,
        }
        if taken[0][1] is not None:
            row["ranks_median_s"] = statistics.median(s[1] for s in taken)  # type: ignore[misc]
            row["serial_median_s"] = statistics.median(s[2] for s in taken)  # type: ignore[misc]
        out[name] = row
    return out


def render(info: dict[str, Any], tiers: dict[str, dict[str, Any]], repeat: int) -> str:
    rows = []
    for backend, got in tiers.items():
        plain = got["group check (verify)"]["median_s"]
        for name in CHECKS:
            row = got[name]
            split = (
                f"{fmt_s(row['ranks_median_s'])} + {fmt_s(row['serial_median_s'])}"
                if "ranks_median_s" in row
                else "—"
            )
            wall = f"{fmt_s(row['median_s'])} (cpu {fmt_s(row['cpu_median_s'])})"
            rows.append([backend, name, wall, split, fmt_ratio(row["median_s"] / plain)])
    table = md_table(
        ["tier", "check (world 8)", "wall (CPU)", "N ranks + serial twin", "÷ group check"],
        rows,
    )
    loads = "; ".join(
        f"{b}: " + ", ".join(f"{x:.1f}" for x in got["load_average_1min"])
        for b, got in tiers.items()
    )
    return (
        f"{machine_line(info)}\n\n{table}\n\nMedian of {repeat} after one untimed call each, "
        f"rounds interleaved. Load average (1 min) per round: {loads}.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["threaded", "gloo"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests.usage.toy
    info = machine()
    tiers = {backend: measure(backend, args.repeat) for backend in args.backends}
    text = render(info, tiers, args.repeat)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / time.strftime("usage-%Y%m%d-%H%M%S")
    dump(stem.with_suffix(".json"), {"machine": info, "repeat": args.repeat, "tiers": tiers})
    stem.with_suffix(".md").write_text(text)
    print(f"wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
