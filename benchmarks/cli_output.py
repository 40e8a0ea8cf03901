"""Issue 31 item 3: the time, peak memory and size of what ``meshsim show`` and ``list`` write
at 1,024 and 131,072 ranks (pictures, ``--json``, the ``list`` text).

Each command runs as ``python -m meshsim ...`` in a process of its own; its wall time, CPU
time and peak resident set (``ru_utime + ru_stime`` and ``ru_maxrss`` from ``os.wait4``) are
its own, interpreter start included. On a shared machine the CPU time is the steadier number.
With ``--baseline DIR`` every case also runs against the meshsim package under ``DIR`` (for
example ``git archive OLD meshsim | tar -x -C DIR``), interleaved case by case with the
checkout's, so both see the same load on a shared machine.

    python benchmarks/cli_output.py [--baseline DIR] [--only NAME,NAME] [--json out.json]
                                    [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import ROOT, loadavg, machine, machine_line  # noqa: E402

#: name -> meshsim arguments ({out} is a file in a scratch folder).
CASES: dict[str, list[str]] = {
    "list": ["list"],
    "megatron 1024 --svg": ["show", "megatron", "-n", "1024", "--no-grid", "--svg", "{out}.svg"],
    "megatron 1024 --png": ["show", "megatron", "-n", "1024", "--no-grid", "--png", "{out}.png"],
    "torch 1024 --svg": ["show", "torch", "-n", "1024", "--no-grid", "--svg", "{out}.svg"],
    "torch 1024 --png": ["show", "torch", "-n", "1024", "--no-grid", "--png", "{out}.png"],
    "megatron 131072 --svg": [
        "show",
        "megatron",
        "-n",
        "131072",
        "--no-grid",
        "--svg",
        "{out}.svg",
    ],
    "megatron 131072 --png": [
        "show",
        "megatron",
        "-n",
        "131072",
        "--no-grid",
        "--png",
        "{out}.png",
    ],
    "torch 131072 --svg": ["show", "torch", "-n", "131072", "--no-grid", "--svg", "{out}.svg"],
    "torch 131072 --png": ["show", "torch", "-n", "131072", "--no-grid", "--png", "{out}.png"],
    "megatron 1024 --json": ["show", "megatron", "-n", "1024", "--json"],
    "megatron 131072 --json": ["show", "megatron", "-n", "131072", "--json"],
    "torch 131072 --json": ["show", "torch", "-n", "131072", "--json"],
}


def image_size(path: Path) -> tuple[int, int] | None:
    """Pixels of a PNG (its IHDR chunk) or an SVG (its width and height attributes)."""
    if not path.exists():
        return None
    if path.suffix == ".png":
        width, height = struct.unpack(">II", path.read_bytes()[16:24])
        return width, height
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    return round(float(root.get("width", 0))), round(float(root.get("height", 0)))


def run_once(args: list[str], package: Path, scratch: Path) -> dict[str, Any]:
    """One command in a fresh interpreter importing meshsim from ``package``."""
    out = scratch / "picture"
    argv = [a.replace("{out}", str(out)) for a in args]
    env = {**os.environ, "PYTHONPATH": str(package), "COLUMNS": "160"}
    stdout = scratch / "stdout"
    started = time.perf_counter()
    with open(stdout, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshsim", *argv],
            stdout=sink,
            stderr=subprocess.PIPE,
            env=env,
            cwd=scratch,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    result: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "exit": os.waitstatus_to_exitcode(status),
        "stdout_bytes": stdout.stat().st_size,
        "stdout_lines": stdout.read_bytes().count(b"\n"),
        "load_1min": loadavg()[:1],
    }
    if result["exit"] != 0:
        result["error"] = err.strip().splitlines()[-1:] if err.strip() else []
    picture = next(
        (p for p in (out.with_suffix(".svg"), out.with_suffix(".png")) if p.exists()), None
    )
    if picture is not None:
        result["image_px"] = image_size(picture)
        result["file_bytes"] = picture.stat().st_size
        picture.unlink()
    return result


def describe(r: dict[str, Any] | None, json_out: bool = False) -> str:
    if r is None:
        return "–"
    if r["exit"] != 0:
        return f"refused (exit {r['exit']}, {r['wall_s']:.1f} s)"
    parts = [f"{r['wall_s']:.1f} s (CPU {r['cpu_s']:.1f} s)", f"{r['peak_rss_mib']:.0f} MiB"]
    if "image_px" in r:
        w, h = r["image_px"]
        parts.append(f"{w} x {h} px")
    elif json_out:
        parts.append(f"{r['stdout_bytes'] / 1e6:.3g} MB of JSON")
    else:
        parts.append(f"{r['stdout_lines']} lines")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="folder holding an older meshsim package")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    opts = parser.parse_args()
    names = [n.strip() for n in opts.only.split(",")] if opts.only else list(CASES)
    info = machine()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="meshsim-cli-bench-") as tmp:
        scratch = Path(tmp)
        for name in names:
            row: dict[str, Any] = {"args": CASES[name]}
            if opts.baseline:
                row["before"] = run_once(CASES[name], opts.baseline, scratch)
            row["after"] = run_once(CASES[name], ROOT, scratch)
            rows[name] = row
            print(
                f"{name}: before {describe(row.get('before'))}; after {describe(row['after'])}",
                flush=True,
            )
    lines = [
        f"Machine: {machine_line(info)}",
        "",
        "| command | before | after |",
        "| :-- | :-- | :-- |",
        *(
            f"| `meshsim {' '.join(CASES[n]).replace('{out}', 'out')}` | "
            f"{describe(rows[n].get('before'), '--json' in CASES[n])} | "
            f"{describe(rows[n]['after'], '--json' in CASES[n])} |"
            for n in names
        ),
    ]
    print("\n".join(lines))
    if opts.markdown:
        opts.markdown.write_text("\n".join(lines) + "\n")
    if opts.json:
        opts.json.write_text(json.dumps({"machine": info, "cases": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
