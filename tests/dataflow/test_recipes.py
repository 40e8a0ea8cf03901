"""End to end: the OLMo-core and torchtitan recipes at world 8 (dp 2 x cp 2 x tp 2).

The right wiring passes; each classic wrong wiring fails with a message naming the mistake.
threaded runs by default; gloo (the same checks across processes) is marked slow.
"""

from __future__ import annotations

import pytest

import meshsim
from meshsim import UsageError
from meshsim.dataflow.recipes import check_dataflow
from tests.releases import needs_flatten_of_flattened, needs_unflatten

LAYOUTS = {
    "olmo-core": {"dp": "fsdp", "cp": 2, "tp": 2},
    "torchtitan": {"dp_shard": 2, "cp": 2, "tp": 2},
}
#: What each wrong wiring's message must say (the ranks, then the mistake).
CAUGHT = {
    "sampler_over_gradient_mesh": (
        "data_error",
        ["ranks 0 and 2 are CP peers", "sampler was split over the gradient group"],
    ),
    "wrapper_over_data_mesh": (
        "gradient_error",
        ["CP peers 0 and 2 share gradient group (0, 2, 4, 6)", "reduces gradients over the data"],
    ),
    "tp_different_seeds": (
        "data_error",
        ["ranks 0 and 1 are TP peers", "different random seeds"],
    ),
}
BACKENDS = ["threaded", pytest.param("gloo", marks=pytest.mark.slow)]
#: torchtitan's recipe builds its meshes as its current build_mesh does (``_unflatten``).
FRAMEWORKS = [
    pytest.param(f, marks=[needs_unflatten] if f == "torchtitan" else []) for f in LAYOUTS
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_right_wiring_passes(framework: str, backend: str) -> None:
    result = check_dataflow(framework, 8, backend, **LAYOUTS[framework])
    assert result.passed, str(result)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wiring", list(CAUGHT))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_wrong_wiring_is_caught_and_named(framework: str, wiring: str, backend: str) -> None:
    result = check_dataflow(framework, 8, backend, wiring=wiring, **LAYOUTS[framework])
    assert not result.passed and result.error is None, str(result)
    field, phrases = CAUGHT[wiring]
    message = getattr(result, field)
    assert message is not None, str(result)
    for phrase in phrases:
        assert phrase in message, message
    other = "gradient_error" if field == "data_error" else "data_error"
    assert getattr(result, other) is None, str(result)  # only the mistake made is reported


def test_the_fake_tier_cannot_move_data() -> None:
    with pytest.raises(UsageError, match="fake backend moves no data"):
        check_dataflow("olmo-core", 8, "fake", **LAYOUTS["olmo-core"])


@needs_flatten_of_flattened
def test_hsdp_runs_on_threaded_as_on_gloo() -> None:
    """Once refused ("not exact on threaded"); each threaded rank now draws from its own
    generator, and the HSDP step is exact there too."""
    result = check_dataflow("olmo-core", 8, "threaded", dp="hsdp", num_replicas=2, cp=2, tp=2)
    assert result.passed, str(result)


def test_conventions_without_a_recipe_are_refused() -> None:
    with pytest.raises(UsageError, match="recipe exists for olmo-core, torchtitan"):
        check_dataflow("megatron", 8, "threaded")


def test_public_names() -> None:
    for name in ("record_batches", "assert_data_parallel", "assert_gradient_sync"):
        assert name in meshsim.__all__ and callable(getattr(meshsim, name))


def test_a_layout_without_gradient_reduction_says_nothing_was_compared() -> None:
    from meshsim.cli import dataflow as dataflow_cli

    result = check_dataflow("olmo-core", 4, "threaded", dp="fsdp", tp=4)  # dp world 1
    assert result.passed and result.error is None, str(result)
    (reason,) = result.not_compared
    assert reason.startswith("assert_gradient_sync compared nothing: every gradient_reduce group")
    assert "PASS only where compared" in str(result)
    assert "gradients the gradient mesh" not in str(result)
    assert dataflow_cli.as_json(result)["not_compared"] == [reason]
