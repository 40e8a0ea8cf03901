"""``show`` and ``verify`` say where a framework's own rules build a broken layout.

verl's FSDP1 engine with ``fsdp_size=1`` (verl#7493) builds a (world, 1) mesh, and torch clamps
HYBRID_SHARD to NO_SHARD over the one-rank shard group: no gradient is averaged with another
rank's. The live build matches verl's code, so ``verify`` passes; the layout is still wrong,
and the user is told so (``--strict`` makes it a failure).
"""

from __future__ import annotations

import json

import pytest

from meshsim.cli.main import main

BROKEN = ["verl", "-n", "4", "--fsdp-size", "1"]
SOUND = ["verl", "-n", "4", "--fsdp-size", "2"]


def test_verify_passes_a_matching_build_and_names_the_finding(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["verify", *BROKEN, "--backend", "fake"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
    assert "PASS: 9 kinds checked" in out
    assert "finding: the layout verl's own rules give here breaks 1 invariant(s)" in out
    assert "gradient_reduce ⊇ data_parallel [get_data_parallel_group]" in out
    assert "never average their gradients" in out


def test_strict_verify_fails_on_the_finding_only(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["verify", *BROKEN, "--backend", "fake", "--strict"]) == 1
    assert "a failure under --strict" in " ".join(capsys.readouterr().out.split())
    assert main(["verify", *SOUND, "--backend", "fake", "--strict"]) == 0
    assert "finding" not in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["show", "verify"])
def test_json_lists_the_findings(verb: str, capsys) -> None:  # type: ignore[no-untyped-def]
    extra = ["--backend", "fake"] if verb == "verify" else []
    assert main([verb, *BROKEN, *extra, "--json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["check"] == "gradient_reduce ⊇ data_parallel"
    assert finding["message"] == (
        "data-parallel groups [(0, 1, 2, 3)] are split across fsdp_reduce groups"
    )
    assert main([verb, *SOUND, *extra, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_show_names_the_finding(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["show", *BROKEN]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "breaks 1 invariant(s):" in out and "--strict" not in out


def test_sweep_counts_the_findings_and_lists_them_per_layout(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["sweep", "-n", "4", "--framework", "verl", "--jobs", "1", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    flagged = {r["id"] for r in report["results"] if r["findings"]}
    assert "verl-4-fsdp_size=1" in flagged
    assert all(r["passed"] for r in report["results"])  # matching verl's code still passes
    err = " ".join(captured.err.split())
    assert "findings: " in err and "gradient_reduce ⊇ data_parallel" in err
