"""Inside a launched job (torchrun's environment), run() uses the job's processes as ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshsim.errors import UsageError
from meshsim.harness import run

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json
    import torch.distributed as dist
    from meshsim.errors import RankFailure
    from meshsim.harness import context, run

    def body(x):
        import torch
        t = torch.ones(1)
        dist.all_reduce(t)
        return [context().rank, dist.get_rank(), t.item() + x]

    def bad():
        if dist.get_rank() == 1:
            raise ValueError("rank one is broken")
        return 0

    res = {"values": list(run(body, 2, "gloo", args=(1,)))}
    try:
        run(bad, 2, "gloo")
    except RankFailure as e:
        res["failure"] = str(e).splitlines()[1]
    res["fake"] = list(run(lambda: dist.get_world_size(), 3, "fake"))  # still simulated
    res["kept_for_later_runs"] = dist.is_initialized()
    print("RESULT", json.dumps(res))
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_run_inside_a_launched_job_uses_the_job(tmp_path: Path) -> None:
    """Two processes with the environment torchrun gives its workers (env:// rendezvous).

    The elastic agent itself is left out: it adds a second rendezvous and seconds of startup
    without changing what the ranks see.
    """
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    base.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    results = [
        json.loads(line.split(" ", 1)[1])
        for out, _ in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == 2 and results[0] == results[1]
    assert results[0] == {
        "values": [[0, 0, 3.0], [1, 1, 3.0]],
        "failure": "rank 1: ValueError: rank one is broken",
        "fake": [3, 3, 3],
        "kept_for_later_runs": True,
    }


def test_world_size_must_match_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UsageError, match=r"WORLD_SIZE=2.*pass world_size=2"):
        run(lambda: 0, 4, "gloo")
