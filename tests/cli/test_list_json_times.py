"""meshsim list, the shared --json envelope, and verify's honest times."""

from __future__ import annotations

import json

from meshsim.model.conventions import CONVENTIONS
from meshsim.model.sweep import layouts
from tests.cli.helpers import json_of, run_cli


def test_list_json_names_every_convention_with_keys_and_kinds() -> None:
    data = json_of(run_cli("list", "--json"))
    assert data["verb"] == "list" and data["exit_code"] == 0
    assert [c["framework"] for c in data["conventions"]] == list(CONVENTIONS)
    megatron = next(c for c in data["conventions"] if c["framework"] == "megatron")
    keys = {k["key"]: k for k in megatron["config_keys"]}
    assert keys["tensor_model_parallel_size"]["flag"] == "--tensor-model-parallel-size"
    kinds = {k["name"]: k for k in megatron["kinds"]}
    assert kinds["tp"]["roles"] == ["tensor"] and "dp-cp" in kinds
    assert megatron["layouts"] == len(layouts(8, "megatron"))
    assert kinds["tp"]["layouts"] == megatron["layouts"]


def test_list_text_for_one_convention() -> None:
    result = run_cli("list", "deepspeed")
    assert result.returncode == 0, result.stderr
    assert "deepspeed" in result.stdout and "--num-pp" in result.stdout
    assert "pipe" in result.stdout and "megatron" not in result.stdout
    bad = run_cli("list", "megatorn")
    assert bad.returncode == 2 and "did you mean 'megatron'" in bad.stderr


def test_json_envelope_is_shared_by_every_verb() -> None:
    runs = {
        "show": run_cli("show", "megatron", "-n", "4", "--tp", "2", "--json"),
        "diff": run_cli("diff", "megatron", "megatron-deepspeed", "-n", "4", "--tp", "2", "--json"),
        "verify": run_cli("verify", "torch", "-n", "2", "--backend", "fake", "--json"),
        "list": run_cli("list", "torch", "--json"),
        "sweep": run_cli("sweep", "-n", "2", "--framework", "torch", "--limit", "1", "--json"),
    }
    for verb, result in runs.items():
        data = json.loads(result.stdout)  # stdout holds the JSON object and nothing else
        assert data["verb"] == verb, verb
        assert data["exit_code"] == result.returncode, (verb, result.stderr)


def test_verify_prints_wall_time_including_rank_start() -> None:
    result = run_cli("verify", "torch", "-n", "2", "--backend", "threaded", "--json")
    data = json_of(result)
    assert data["passed"] is True
    assert data["wall_seconds"] >= data["seconds"] > 0
    text = run_cli("verify", "torch", "-n", "2", "--backend", "threaded")
    assert text.returncode == 0, text.stderr
    assert (
        " s wall (" in text.stdout and " s build+check; the rest starts the ranks)" in text.stdout
    )


def test_list_prints_one_line_per_convention_by_default() -> None:
    """1,144 lines before: every convention's keys and kinds. Now a line each; --all (or naming
    conventions) gives the full listing, and --json is always full."""
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(CONVENTIONS) + 1 and "--all" in lines[0]
    for name, line in zip(CONVENTIONS, lines[1:]):
        assert line.split()[0] == name and " keys  " in line
    megatron = next(line for line in lines if line.startswith("megatron "))
    assert "15 keys" in megatron and "initialize_model_parallel" in megatron
    full = run_cli("list", "--all")
    assert full.returncode == 0, full.stderr
    assert "--num-pp" in full.stdout and "hyper_comm_grid[tp]" in full.stdout
    assert len(full.stdout.splitlines()) > 10 * len(lines)
