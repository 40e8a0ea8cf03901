"""Megatron-DeepSpeed builder vs the reference, both lines: fake (every rank), threaded, gloo."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim.builders import megatron_deepspeed as builder
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.model.conventions import megatron_deepspeed
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.builders._ranks import build_every_rank, on_rank

VARIANTS = ["upstream", "habana-2024"]
TWINS = {"use_distributed_optimizer": True}
SHAPES: list[tuple[int, dict[str, Any]]] = [
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "use_fp8": True,
            **TWINS,
        },
    ),
    (8, {"sequence_parallel_size": 4, "use_fp8": True, **TWINS}),
    (8, {"sequence_parallel_size": 2}),  # upstream: dp:gloo's getter asserts
    (8, {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": -2, **TWINS}),
    (4, {}),
]
CASES = [(world, {"variant": v, **config}) for v in VARIANTS for world, config in SHAPES]
IDS = [f"{w}-" + ",".join(f"{k}={v}" for k, v in c.items()) for w, c in CASES]

#: Beyond refused_configs: the other ways upstream's arithmetic fails.
MORE_REFUSED: list[dict[str, Any]] = [
    {"pipeline_model_parallel_size": 0},
    {"pipeline_model_parallel_size": -2},
    {"tensor_model_parallel_size": -2, "pipeline_model_parallel_size": -2},  # new_group([])
    {"tensor_model_parallel_size": -1, "sequence_parallel_size": -16},  # dp 0
    {
        "tensor_model_parallel_size": -1,
        "pipeline_model_parallel_size": 2,
        "sequence_parallel_size": -1,
        "pipeline_model_parallel_split_rank": 5,
    },
    {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": -5},
]
REFUSED = [*megatron_deepspeed.refused_configs(8)] + [
    {"variant": v, **c} for v in VARIANTS for c in MORE_REFUSED
]


@pytest.mark.parametrize(("world", "config"), CASES, ids=IDS)
def test_builder_matches_reference_on_every_fake_rank(world: int, config: dict[str, Any]) -> None:
    expected = meshsim.expect("megatron-deepspeed", world, **config)
    observed = build_every_rank("megatron-deepspeed", world, config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert set(expected.kinds()) | set(expected.unavailable()) == seen


def test_gloo_twin_per_variant_on_a_rank() -> None:
    config = {"sequence_parallel_size": 2}
    upstream = on_rank("megatron-deepspeed", 8, {**config, **TWINS}, rank=3)
    assert upstream.groups["dp"].members == upstream.groups["dp:gloo"].members == (1, 3, 5, 7)
    assert upstream.groups["seq_dp"].members == tuple(range(8))
    assert "dp:gloo" in on_rank("megatron-deepspeed", 8, config, rank=3).absent
    habana = on_rank("megatron-deepspeed", 8, {**config, "variant": "habana-2024"}, rank=3)
    assert "dp:gloo" not in (*habana.groups, *habana.absent)


@pytest.mark.parametrize("config", REFUSED, ids=str)
def test_builder_refuses_what_the_reference_refuses(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect("megatron-deepspeed", 8, **config)
    with pytest.raises(RuntimeError) as built:
        on_rank("megatron-deepspeed", 8, config, rank=0)
    assert reference.value.upstream is not None
    assert getattr(built.value, "upstream", None) == reference.value.upstream


COMMUNICATING = [
    LayoutCase("megatron-deepspeed", 4, {"variant": v, "sequence_parallel_size": 2, **TWINS})
    for v in VARIANTS
] + [
    LayoutCase("megatron-deepspeed", 4, {"pipeline_model_parallel_size": 4,
                                         "pipeline_model_parallel_split_rank": 1}),
    LayoutCase("megatron-deepspeed", 4, {"variant": "habana-2024", "tensor_model_parallel_size": 2,
                                         "use_fp8": True}),
]  # fmt: skip


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_communicating_tiers(backend: str) -> None:
    results = list(verify_many(COMMUNICATING, backend, timeout=120))
    for result in results:
        assert result.passed and result.rejected is None, str(result)
    assert "dp:gloo" in results[0].kinds_checked and "dp:gloo" in results[1].kinds_checked


def test_a_twin_on_the_default_backend_is_caught_on_threaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The twins' backend is checked, not only their members: a builder that makes the twin on
    the world's backend fails verification."""
    monkeypatch.setattr(builder, "_gloo_groups", builder.new_groups)
    [result] = verify_many(COMMUNICATING[:1], "threaded", timeout=120)
    assert not result.passed
    assert "dp:gloo" in str(result) and "backend" in str(result)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 8),
    degrees=st.tuples(*[st.integers(-3, 4)] * 3),
    vpp=st.sampled_from([None, 2]),
    split=st.sampled_from([None, -3, 0, 1, 3]),
    variant=st.sampled_from(VARIANTS),
)
def test_builder_and_reference_agree_on_any_small_config(
    world: int, degrees: tuple[int, int, int], vpp: int | None, split: int | None, variant: str
) -> None:
    """Either both build the same groups or both refuse with the same upstream type, 0 and
    negative degrees included."""
    tp, pp, sp = degrees
    config = {"variant": variant, "tensor_model_parallel_size": tp,
              "pipeline_model_parallel_size": pp, "sequence_parallel_size": sp,
              "virtual_pipeline_model_parallel_size": vpp,
              "pipeline_model_parallel_split_rank": split, "use_fp8": True}  # fmt: skip
    try:
        expected = meshsim.expect("megatron-deepspeed", world, **config)
    except LayoutError as refusal:
        with pytest.raises(RuntimeError) as built:
            on_rank("megatron-deepspeed", world, config, rank=world - 1)
        assert getattr(built.value, "upstream", None) == refusal.upstream, str(refusal)
        return
    assert diff(build_every_rank("megatron-deepspeed", world, config), expected) is None
