"""What the frameworks print while sweep builds their groups stays out of sweep's own output:
it goes with each layout's result and is shown only where that layout fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import meshsim.verify as verify_module
from meshsim.cli import sweep as sweeping
from meshsim.cli.sweep_remote import Chunk, examine
from meshsim.model.sweep import LayoutCase
from meshsim.verify import VerifyResult

CASES = [LayoutCase("torch", 2, {"mesh_shape": (2,), "mesh_dim_names": (name,)}) for name in "ab"]


def _noisy_verify_many(cases: Any, tier: str, **_: Any) -> Iterator[VerifyResult]:
    """Each case prints as a framework does, per rank: through Python and straight to the
    descriptors; the second case fails."""
    for index, case in enumerate(cases):
        print(f"Using topology for case {index}")
        os.write(2, f"[WARNING] native stderr of case {index}\n".encode())
        error = "planted failure" if index == 1 else None
        yield VerifyResult(case.framework, 2, case.config, tier, False, None, (), 0.0, error)


def test_framework_prints_are_kept_out_of_sweeps_output_and_shown_for_a_failure(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(verify_module, "verify_many", _noisy_verify_many)
    found = {i: answer.result for i, answer in examine(Chunk(CASES, "threaded", 5.0))}
    printed = capfd.readouterr()
    assert "Using topology" not in printed.out + printed.err
    assert "native stderr" not in printed.out + printed.err
    assert found[0].output == "Using topology for case 0\n[WARNING] native stderr of case 0\n"
    passing = sweeping.Outcome(CASES[0], {"threaded": found[0]})
    failing = sweeping.Outcome(CASES[1], {"threaded": found[1]})
    assert passing.passed and passing.message() == ""
    message = failing.message()
    assert message.startswith("[threaded] planted failure\n")
    assert "what the framework printed while building it:" in message
    assert "Using topology for case 1" in message and "case 0" not in message


def test_on_the_fake_tier_a_layout_gets_the_output_of_the_batch_it_was_built_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def batch(cases: Any, tier: str, **_: Any) -> Iterator[VerifyResult]:
        print("built the whole batch")  # the fake tier builds a batch in its first step
        for case in cases:
            yield VerifyResult(case.framework, 2, case.config, tier, False, None, (), 0.0, None)

    monkeypatch.setattr(verify_module, "verify_many", batch)
    found = {i: answer.result for i, answer in examine(Chunk(CASES, "fake", 5.0))}
    assert [found[i].output for i in (0, 1)] == ["built the whole batch\n"] * 2
