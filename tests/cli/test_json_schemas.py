"""Every verb's ``--json`` carries ``schema_version`` and matches its documented schema
(``meshsim/cli/schemas/VERB.json``, shipped with the package; issue 28 item 6)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from meshsim.cli.main import VERBS, main
from meshsim.cli.render import JSON_SCHEMA_VERSION
from tests.cli.json_schema import errors

RUNS = {
    "show": ["show", "megatron", "-n", "8", "--tp", "2", "--gpus-per-node", "4"],
    "diff": ["diff", "megatron", "megatron", "-n", "8", "--tp", "2", "--b-order", "tp-cp-pp-ep-dp"],
    "verify": ["verify", "verl", "-n", "4", "--fsdp-size", "1", "--backend", "fake", "--strict"],
    "sweep": ["sweep", "-n", "2", "--framework", "torch", "--jobs", "1", "--gpus-per-node", "1"],
    "meshes": [
        "meshes",
        "olmo-core",
        "-n",
        "8",
        "--dp",
        "hsdp",
        "--num-replicas",
        "2",
        "--expert-mesh-ep",
        "4",
    ],
    "list": ["list", "torch"],
}


def schema(verb: str) -> dict[str, Any]:
    text = resources.files("meshsim.cli").joinpath("schemas", f"{verb}.json").read_text()
    return json.loads(text)


def test_every_verb_has_a_schema() -> None:
    assert set(RUNS) == set(VERBS)
    for verb in VERBS:
        assert schema(verb)["properties"]["schema_version"] == {
            "enum": [JSON_SCHEMA_VERSION],
            "description": schema(verb)["properties"]["schema_version"]["description"],
        }


@pytest.mark.parametrize("verb", list(RUNS))
def test_json_output_matches_its_schema(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([*RUNS[verb], "--json"])
    except SystemExit as exit_info:  # pragma: no cover - a refusal fails the test below
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    out = captured.out
    data = json.loads(out)
    assert data["verb"] == verb and data["schema_version"] == JSON_SCHEMA_VERSION
    assert data["exit_code"] == code
    assert errors(data, schema(verb)) == []
    if verb == "verify":  # verl fsdp_size=1: a finding fails --strict, and is in the JSON
        assert code == 1 and data["findings"]


def test_the_validator_finds_what_breaks_a_schema() -> None:
    shape = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a"]}},
        },
        "required": ["n"],
        "additionalProperties": False,
    }
    assert errors({"n": 1, "tags": ["a"]}, shape) == []
    assert errors({"n": True}, shape) == ["$.n: bool True is not integer"]
    assert errors({}, shape) == ["$: missing 'n'"]
    assert errors({"n": 1, "x": 0}, shape) == ["$: 'x' is not in the schema"]
    assert errors({"n": 1, "tags": ["b"]}, shape) == ["$.tags[0]: 'b' is not one of ['a']"]
    with pytest.raises(ValueError, match="keywords this validator lacks"):
        errors(1, {"minimum": 0})
