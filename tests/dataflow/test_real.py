"""The recipe on the real frameworks' own mesh builders (``--real``), gloo, world 8."""

from __future__ import annotations

import pytest

from meshsim.dataflow.recipes import check_dataflow
from tests.real._helpers import require

OLMO = require("olmo-core", "olmo_core")
TITAN = require("torchtitan", "torchtitan")
CASES = [
    pytest.param("olmo-core", {"dp": "fsdp", "cp": 2, "tp": 2}, marks=OLMO),
    pytest.param("torchtitan", {"dp_shard": 2, "cp": 2, "tp": 2}, marks=TITAN),
]


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "config"), CASES)
@pytest.mark.parametrize("wiring", ["correct", "wrapper_over_data_mesh"])
def test_real_mesh_builder_recipe(framework: str, config: dict, wiring: str) -> None:
    result = check_dataflow(framework, 8, "gloo", wiring=wiring, real=True, timeout=300, **config)
    assert result.error is None, str(result)
    assert result.passed == (wiring == "correct"), str(result)
