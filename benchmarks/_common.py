"""Shared pieces of the benchmarks: timing, machine description, formatting.

Nothing here imports torch, so ``benchmarks/run.py`` stays light while it orchestrates the
sections (each section runs in its own subprocess).

Timing rule: the machine may be shared, so every number is a median of several samples, the
variants compared in one table are measured *interleaved* (round r runs every variant once,
starting from a rotating offset) so a burst of load hits all of them alike, and the load
average is recorded next to each section. Where a single process does all the work (the
reference model, the fake tier) the CPU time of the process is reported next to the wall time:
it is much less sensitive to other people's jobs.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import meshsim from this checkout
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------- the machine


#: The variables a launched job sets: a benchmark's child command must not see them.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def job_free_env() -> dict[str, str]:
    """This process's environment without a launched job's variables (a command started by
    a benchmark run under torchrun must not think it is one of the job's ranks)."""
    return {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def meminfo_gib(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip() or None
    if commit and dirty.stdout.strip():
        commit += "+dirty"
    return commit


def machine() -> dict[str, Any]:
    """What the numbers were measured on (no torch import: versions come from metadata)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_at_start": loadavg(),
        "mem_total_gib": round(meminfo_gib("MemTotal") or 0, 1),
        "mem_available_gib_at_start": round(meminfo_gib("MemAvailable") or 0, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            name: _version(name)
            for name in ("torch", "numpy", "megatron-core", "deepspeed", "ai2-olmo-core")
        },
        "meshsim_commit": _git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def machine_line(info: dict[str, Any]) -> str:
    load = " / ".join(f"{x:.2f}" for x in info["load_average_at_start"])
    v = info["versions"]
    return (
        f"{info['cpu_model']}, {info['cpus_usable']} cores, {info['mem_total_gib']} GiB; "
        f"load average at start {load} (1/5/15 min); Python {info['python']}, "
        f"torch {v.get('torch')}, megatron-core {v.get('megatron-core')}, "
        f"deepspeed {v.get('deepspeed')}; meshsim {info['meshsim_commit']}"
    )


# ---------------------------------------------------------------------------- timing


def _proc_cpu(pid: int) -> float:
    """utime + stime of a live process, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now() -> float:
    """CPU seconds of this process, its reaped children and its live meshsim pool workers.

    Every number is reported with CPU time because the machine is shared: wall time grows
    with the load, CPU time much less. A pool worker replaced during a call takes its CPU
    with it (undercount; rare: only workers that leaked state are replaced).
    """
    from meshsim.harness.pool import pool_pids

    t = os.times()
    return (
        time.process_time()
        + t.children_user
        + t.children_system
        + sum(_proc_cpu(p) for p in pool_pids())
    )


def sample(fn: Callable[[], object]) -> tuple[float, float]:
    """One call: (wall seconds, CPU seconds of this process, its children and pool workers)."""
    gc.collect()
    cpu = cpu_now()
    wall = time.perf_counter()
    fn()
    return time.perf_counter() - wall, cpu_now() - cpu


def summary(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples]
    return {
        "median_s": statistics.median(walls),
        "min_s": min(walls),
        "max_s": max(walls),
        "cpu_median_s": statistics.median(cpus),
        "n": len(walls),
        "samples_s": [round(w, 6) for w in walls],
    }


def interleaved(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    *,
    budget_s: dict[str, float] | None = None,
    warmup: bool | Sequence[str] = True,
) -> dict[str, dict[str, Any]]:
    """Median of ``rounds`` samples of every variant, measured round-robin.

    ``warmup``: run every variant (True) or the named ones once, untimed, first.
    ``budget_s[name]``: once a variant has spent that long, it gets no more samples (slow
    baselines at huge worlds keep at least one). A variant that raises is recorded with its
    error and dropped from later rounds.
    """
    names = list(variants)
    spent = dict.fromkeys(names, 0.0)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    warm = names if warmup is True else list(warmup or ())
    for name in warm:
        try:
            variants[name]()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name in errors:
                continue
            if samples[name] and budget_s and spent[name] >= budget_s.get(name, float("inf")):
                continue
            try:
                wall, cpu = sample(variants[name])
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            samples[name].append((wall, cpu))
            spent[name] += wall
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name in errors and not samples[name]:
            out[name] = {"error": errors[name]}
        else:
            out[name] = summary(samples[name])
    return out


# ---------------------------------------------------------------------------- formatting


def fmt_s(seconds: float | None) -> str:
    """12.3 µs / 4.56 ms / 1.23 s / 2.0 min."""
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs" if seconds >= 1e-5 else f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    if ratio >= 100:
        return f"{ratio:,.0f}×"
    if ratio >= 10:
        return f"{ratio:.0f}×"
    return f"{ratio:.1f}×"


def fmt_mib(kib: float | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:,.0f} MiB"


def ratio(slow: dict[str, Any] | None, fast: dict[str, Any] | None) -> float | None:
    if not slow or not fast or "median_s" not in slow or "median_s" not in fast:
        return None
    if fast["median_s"] <= 0:
        return None
    return slow["median_s"] / fast["median_s"]


def cell(result: dict[str, Any] | None) -> str:
    if not result:
        return "n/a"
    if "skipped" in result:
        return "skipped¹"
    if "error" in result:
        return "error¹"
    if "cpu_median_s" in result:
        return f"{fmt_s(result['median_s'])} (cpu {fmt_s(result['cpu_median_s'])})"
    return fmt_s(result["median_s"])


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table, first column left-aligned, the rest right-aligned."""
    align = [":--"] + ["--:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def dump(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def vm_status(pid: int | str = "self") -> dict[str, int]:
    """VmHWM / VmRSS / VmPeak of a process, in KiB (empty when it is gone)."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "VmPeak", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def children(pid: int | str = "self") -> list[int]:
    """Direct children of ``pid`` (every thread's children list)."""
    pids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def section_main(
    doc: str | None, run: Callable[[bool], dict[str, Any]], render: Callable[[Any], str]
) -> None:
    """The command line every benchmark section shares: ``[--quick] [--json FILE]``."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(args.quick)
    result["seconds"] = time.perf_counter() - start
    print(render(result))
    print(f"\n({fmt_s(result['seconds'])})")
    if args.json:
        dump(args.json, result)


T = TypeVar("T")


def take_shard(items: Sequence[T], spec: str) -> list[T]:
    """``--shard I/N``: every N-th item from the I-th, so N runs side by side cover them all."""
    index, count = (int(part) for part in spec.split("/"))
    return list(items[index::count])
