"""``meshsim meshes``: the reference's meshes and the builder's live ones agree alike."""

from __future__ import annotations

import pytest

from meshsim.model import torch_release
from tests.cli.helpers import assert_bad_input, json_of, run_cli

OLMO_EXPERT = ("olmo-core", "-n", "8", "--dp", "hsdp", "--num-replicas", "2")
MEANT = (
    "--same",
    "main:dp_shard=expert:ep_shard",
    "--same",
    "main:dp_replicate=expert:ep_replicate",
)


def _findings(report: dict) -> set[tuple[int, str, str]]:
    return {(d["rank"], d["aspect"], d["detail"].split(";")[0]) for d in report["disagreements"]}


def test_reference_names_one_group_twice_then_agrees_when_declared() -> None:
    report = json_of(run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", "--json"))
    assert report["exit_code"] == 1 and report["meshes"] == ["main", "expert"]
    assert {d["aspect"] for d in report["disagreements"]} == {"two names, one group"}
    assert len(report["disagreements"]) == 16
    text = run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4")
    assert text.returncode == 1
    assert "ranks 0-7: meshes 'main' and 'expert', two names, one group" in text.stdout
    agreed = run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", *MEANT)
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr
    assert "meshes main, expert agree on every rank (in the reference)" in agreed.stdout


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_live_meshes_find_what_the_reference_finds(backend: str) -> None:
    reference = json_of(run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", "--json"))
    live = json_of(
        run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", "--backend", backend, "--json")
    )
    assert live["backend"] == backend and live["exit_code"] == 1
    assert _findings(live) == _findings(reference)


def test_bad_input_is_one_line() -> None:
    assert_bad_input(run_cli("meshes", "olmo-core", "-n", "8", "--dp", "fsdp"), "one mesh")
    assert_bad_input(
        run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", "--same", "dp_shard=ep_shard"),
        "--same takes MESH:DIM=MESH:DIM",
    )
    assert_bad_input(
        run_cli("meshes", *OLMO_EXPERT, "--expert-mesh-ep", "4", "--data-dims", "trainer=dp"),
        "no mesh named ['trainer']",
    )
    assert_bad_input(
        run_cli("meshes", "megatron", "-n", "8", "--backend", "threaded"), "does not hand out"
    )


def test_transformers_trainer_mesh_agrees_as_declared_and_whole_world_tp_is_shared() -> None:
    """transformers declares its Trainer's dp_shard to be the model's fsdp (SAME_GROUPS); a
    whole-world tp dim is torch's default group in all three meshes (transformers#48383)."""
    agreed = run_cli("meshes", "transformers", "-n", "8", "--tp", "2", "--dp-shard", "4")
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr
    assert "meshes main, expert, trainer agree" in agreed.stdout
    live = json_of(
        run_cli(
            "meshes",
            "transformers",
            "-n",
            "4",
            "--tp",
            "4",
            "--backend",
            "gloo",
            "--independent",
            "--json",
        )
    )
    shared = {
        tuple(d["meshes"]) for d in live["disagreements"] if d["aspect"] == "shared communicator"
    }
    if (torch_release.installed() or (2, 10)) >= (2, 10):
        assert shared == {("main", "expert"), ("main", "trainer"), ("expert", "trainer")}
    else:  # only the Trainer's 1-D mesh gets the default group: equal, not shared, tp meshes
        assert not shared
        equal = {
            tuple(d["meshes"]) for d in live["disagreements"] if d["aspect"] == "equal sub-meshes"
        }
        assert equal == {("main", "trainer")}
