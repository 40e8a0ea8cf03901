"""Two torchrun agents on this machine as two "nodes": c10d rendezvous on 127.0.0.1, gloo.

This is the multi-node path a cluster job takes (an elastic agent per node, one rendezvous,
workers on both agents forming one world), run for real with 2 nodes × 2 processes. It checks
that `meshsim.run` and `meshsim verify` use the job's ranks in place, that every rank observes
the groups the reference predicts (proven by all-gathers across the two agents), and that only
global rank 0 prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import meshsim

ROOT = Path(__file__).resolve().parents[2]
NODES, PROCS_PER_NODE = 2, 2
WORLD = NODES * PROCS_PER_NODE

RUN_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch.distributed as dist
    import meshsim
    from torch.distributed.device_mesh import init_device_mesh

    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        seen = meshsim.observe(mesh)  # every group proven by an all-gather across the nodes
        return os.environ["GROUP_RANK"], seen

    values = list(meshsim.run(body, int(os.environ["WORLD_SIZE"]), "gloo", timeout=60))
    if dist.get_rank() == 0:
        print("RESULT", json.dumps([
            {
                "rank": seen.rank,
                "node": node,
                "groups": {
                    name: {"members": view.members, "gathered": view.gathered}
                    for name, view in seen.groups.items()
                },
            }
            for node, seen in values
        ]))
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_two_nodes(
    target: list[str], cwd: Path, rendezvous: str = "c10d"
) -> list[subprocess.CompletedProcess[str]]:
    """Start one torchrun agent per node against one rendezvous; wait for both.

    ``c10d`` (elastic) hands out node ranks in arrival order and ignores ``--node-rank``;
    ``static`` (torchrun's default, with ``--master-addr``) keeps them, so global rank 0 is on
    node 0, as the README's recipe says.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), COLUMNS="200")
    port = _free_port()
    meeting = (
        [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=meshsim-two-nodes",
            "--local-addr=127.0.0.1",
        ]
        if rendezvous == "c10d"
        else ["--master-addr=127.0.0.1", f"--master-port={port}"]
    )
    agents = []
    for node in range(NODES):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={NODES}",
            f"--nproc-per-node={PROCS_PER_NODE}",
            f"--node-rank={node}",
            *meeting,
            "--max-restarts=0",
            *target,
        ]
        agents.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=240)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.stdout}\n{result.stderr[-4000:]}"
    return results


def test_run_on_two_torchrun_nodes_observes_every_ranks_groups(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "job.py"
    script.write_text(RUN_SCRIPT)
    results = _launch_two_nodes([str(script)], tmp_path)

    printed = [line for r in results for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert len(printed) == 1, "only global rank 0 prints"
    values = json.loads(printed[0].split(" ", 1)[1])
    assert [v["rank"] for v in values] == list(range(WORLD))
    assert {v["node"] for v in values} == {"0", "1"}, "the world spans both agents"
    expected = meshsim.expect("torch", WORLD, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    for v in values:
        assert set(v["groups"]) == {"dp", "tp"}
        for dim, view in v["groups"].items():
            want = list(expected.group_of(v["rank"], dim))
            assert view["members"] == want, (v["rank"], dim)
            assert view["gathered"] == want, (v["rank"], dim, "all-gather across nodes")


def test_verify_on_two_torchrun_nodes_prints_once_on_node_0(tmp_path: Path) -> None:
    """The README's recipe as written: static rendezvous, ``--node-rank`` kept, node 0 prints.
    (With c10d rendezvous the printout landed on whichever agent joined first.)"""
    pytest.importorskip("torch.distributed.run")
    verify = ["-m", "meshsim", "verify", "megatron", "--tp", "2", "--backend", "gloo"]
    results = _launch_two_nodes(verify, tmp_path, rendezvous="static")

    stdout = "".join(r.stdout for r in results)
    assert stdout.count("PASS") == 1, stdout
    assert f"megatron world_size={WORLD}" in stdout
    printing_nodes = [node for node, r in enumerate(results) if "PASS" in r.stdout]
    assert printing_nodes == [0]
