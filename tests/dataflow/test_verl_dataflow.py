"""The verl data-flow recipe (FSDP engine): batch chunk i to the workers whose data-parallel
rank is i, Ulysses peers splitting each sequence, FSDP over the device mesh. The right wiring
passes, the wrong ones are caught; FSDP1 with ``fsdp_size=1`` (verl#7493) trains as verl's
code does, and ``verify`` names it as a finding (``tests/cli/test_findings.py``)."""

from __future__ import annotations

import pytest

from meshsim.dataflow.recipes import check_dataflow
from meshsim.errors import UsageError

ULYSSES = {"fsdp_size": 2, "ulysses_sequence_parallel_size": 2}
CAUGHT = {
    "sampler_over_gradient_mesh": ("data_error", "ranks 0 and 1 are CP peers"),
    "wrapper_over_data_mesh": ("gradient_error", "CP peers 0 and 1 share gradient group"),
}


@pytest.mark.parametrize(
    "config", [ULYSSES, {"strategy": "fsdp2", "fsdp_size": 2}, {"fsdp_size": 1}], ids=str
)
def test_the_right_wiring_passes(config: dict) -> None:
    result = check_dataflow("verl", 8 if config is ULYSSES else 4, "threaded", **config)
    assert result.passed, str(result)


@pytest.mark.parametrize("wiring", list(CAUGHT))
def test_each_wrong_wiring_is_caught(wiring: str) -> None:
    result = check_dataflow("verl", 8, "threaded", wiring=wiring, **ULYSSES)
    field, phrase = CAUGHT[wiring]
    assert not result.passed and result.error is None, str(result)
    assert phrase in (getattr(result, field) or ""), str(result)


def test_the_torchtitan_engine_points_at_torchtitans_recipe() -> None:
    with pytest.raises(UsageError, match="verify torchtitan --dataflow"):
        check_dataflow("verl", 4, "threaded", strategy="torchtitan", data_parallel_shard_size=4)
