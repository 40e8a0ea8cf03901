"""A downstream plugin suite's wall time, serial against ``pytest -n 2``, and its first gloo item.

The suite (written to a temp dir): 17 gloo items at worlds 2, 4 and 8 (a mesh built and its
groups proven by an all-gather), three of them on one ``distributed_fixture``, and one xfail
whose rank raises (the item after a failure pays for a replaced world). Each mode runs in a
fresh ``python -m pytest`` (the cold pool included, as CI pays it); the first gloo item's own
time comes from ``--durations``.

    python benchmarks/plugin_suite.py [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import job_free_env

SUITE = """
import pytest
import torch
import torch.distributed as dist

import meshsim
from meshsim.fixtures import distributed_fixture


def _mesh_round(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    shape = (2, world_size // 2) if world_size > 2 else (world_size,)
    names = ("dp", "tp") if len(shape) == 2 else ("dp",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for name in names:
        group = mesh.get_group(name)
        out = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, torch.ones(1) * dist.get_rank(), group=group)


@distributed_fixture(world_size=4)
def shards(rank, world_size):
    return rank * 10


@pytest.mark.meshsim(world_size=8, backend="gloo")
def test_first_world8(rank, world_size):
    _mesh_round(world_size)

"""

BODY = """
@pytest.mark.meshsim(world_size={world}, backend="gloo")
def test_w{world}_{i}(rank, world_size):
    _mesh_round(world_size)
"""

FIXTURE_BODY = """
@pytest.mark.meshsim(world_size=4, backend="gloo")
def test_fixture_{i}(rank, shards):
    assert shards == rank * 10
"""

FAILING = """
@pytest.mark.xfail(strict=True, reason="a rank raises: the next item gets a fresh world")
@pytest.mark.meshsim(world_size=4, backend="gloo")
def test_a_rank_raises(rank):
    if rank == 1:
        raise RuntimeError("planted")
"""


def write_suite(root: Path) -> int:
    parts = [SUITE]
    count = 1
    for world, n in ((2, 4), (4, 4), (8, 4)):
        for i in range(n):
            parts.append(BODY.format(world=world, i=i))
            count += 1
    parts.append(FAILING)
    count += 1
    for i in range(3):
        parts.append(FIXTURE_BODY.format(i=i))
        count += 1
    # One module: xdist's load scheduler hands its items to both workers.
    (root / "test_suite.py").write_text("\n".join(parts))
    return count


def run_once(root: Path, xdist: bool) -> dict[str, float]:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0"]
    args += ["-n", "2"] if xdist else ["-p", "no:xdist"]
    env = job_free_env()
    start = time.perf_counter()
    done = subprocess.run(args, cwd=root, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the suite failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    first = re.search(r"([\d.]+)s call\s+test_suite.py::test_first_world8", done.stdout)
    return {"wall_s": wall, "first_world8_call_s": float(first.group(1)) if first else -1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshsim-plugin-suite-") as tmp:
        root = Path(tmp)
        items = write_suite(root)
        for _ in range(args.repeat):
            for xdist in (False, True):  # interleaved: the load drifts
                row = {"mode": "-n 2" if xdist else "serial", **run_once(root, xdist)}
                row["load_1min"] = os.getloadavg()[0]
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for mode in ("serial", "-n 2"):
        walls = sorted(r["wall_s"] for r in rows if r["mode"] == mode)
        firsts = sorted(r["first_world8_call_s"] for r in rows if r["mode"] == mode)
        summary[mode] = {"wall_s_median": walls[len(walls) // 2], "first_s": firsts}
    print(json.dumps({"items": items, "summary": summary}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
