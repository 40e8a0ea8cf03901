"""The Lightning data-flow recipe: the sampler on ``distributed_sampler_kwargs`` (the
``data_parallel`` dim), FSDP2 over ``device_mesh["data_parallel"]``, TP over
``device_mesh["tensor_parallel"]``; the right wiring passes, TP peers seeded apart are caught.

Lightning's data mesh is its gradient mesh, so the two mesh mix-ups the other recipes catch
are the right wiring here, and pass.
"""

from __future__ import annotations

import importlib.util

import pytest

from meshsim.dataflow.recipes import check_dataflow

LAYOUT = {"data_parallel_size": 2, "tensor_parallel_size": 2}


@pytest.mark.parametrize("wiring", ["correct", "sampler_over_gradient_mesh"])
def test_the_right_wiring_passes(wiring: str) -> None:
    result = check_dataflow("lightning", 4, "threaded", wiring=wiring, **LAYOUT)
    assert result.passed, str(result)


def test_tp_peers_seeded_apart_are_caught() -> None:
    result = check_dataflow("lightning", 4, "threaded", wiring="tp_different_seeds", **LAYOUT)
    assert not result.passed and result.error is None, str(result)
    assert "ranks 0 and 1 are TP peers" in (result.data_error or ""), str(result)


@pytest.mark.requires_framework("lightning")
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_real_lightning_wiring_passes_on_gloo() -> None:
    result = check_dataflow("lightning", 4, "gloo", real=True, num_nodes=2)
    assert result.passed, str(result)
