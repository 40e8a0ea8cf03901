"""Megatron-DeepSpeed convention: the legacy loops, Ulysses SP, embeddings, amax, errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshsim
from meshsim import Groups, LayoutError
from meshsim.model.conventions import megatron_deepspeed
from meshsim.model.sweep import divisors, ordered_factorizations

SHARED = {
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "mp": "tp-pp",
    "amax": "tp-dp",
    "embedding": "embedding",
    "position_embedding": "position_embedding",
}


def expect(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("megatron-deepspeed", world, **config)


def loops(world: int, tp: int, pp: int, sp: int) -> dict[str, list[list[int]]]:
    """The seed's group loops, restated: what each kind must hold, list for list."""
    dp = world // (tp * pp * sp)
    block = world // pp
    stride = sp if sp > 1 else tp
    data = [
        list(range(s * block + j, (s + 1) * block, stride))
        for s in range(pp)
        for j in range(stride)
    ]
    seq_dp = (
        [list(range(i * sp * dp, (i + 1) * sp * dp)) for i in range(world // (sp * dp))]
        if sp > 1
        else data
    )
    model_source = seq_dp if sp > 1 else data
    width = sp * dp if sp > 1 else dp
    return {
        "dp": data,
        "sp": [list(range(i * sp, (i + 1) * sp)) for i in range(world // sp)],
        "seq_dp": seq_dp,
        "mp": [[g[i] for g in model_source] for i in range(width)],
        "tp": [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)],
        "pp": [list(range(i, world, block)) for i in range(block)],
        "amax": [list(range(i * tp * dp, (i + 1) * tp * dp)) for i in range(world // (tp * dp))],
    }


@st.composite
def split_world(draw: st.DrawFn, max_world: int = 64) -> tuple[int, int, int, int]:
    """(world, tp, pp, sp): either tp × pp with sp = 1, or Ulysses sp with tp = pp = 1."""
    world = draw(st.integers(1, max_world))
    if draw(st.booleans()):
        return world, 1, 1, draw(st.sampled_from(divisors(world)))
    tp = draw(st.sampled_from(divisors(world)))
    return world, tp, draw(st.sampled_from(divisors(world // tp))), 1


def test_docstring_example_16_gpus_tp2_pp4() -> None:
    exp = expect(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert exp.groups("dp") == Groups(
        [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    )
    assert exp.groups("tp") == Groups(
        [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    )
    assert exp.groups("pp") == Groups(
        [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    )
    assert exp.groups("embedding") == Groups([(0, 12), (1, 13), (2, 14), (3, 15)])
    assert exp.groups("position_embedding") == Groups([(0,), (1,), (2,), (3,)])
    assert exp.groups("seq_dp") == exp.groups("dp")
    assert exp.groups("sp") == Groups([(i,) for i in range(16)])
    assert "amax" not in exp.kinds()


def test_ulysses_sequence_parallel() -> None:
    exp = expect(8, sequence_parallel_size=4, use_fp8=True)
    assert exp.groups("dp") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert exp.groups("sp") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert exp.groups("seq_dp") == Groups([tuple(range(8))])
    assert exp.groups("mp") == Groups([(i,) for i in range(8)])
    # amax takes contiguous blocks of tp × dp = 2, unlike the strided dp groups.
    assert exp.groups("amax") == Groups([(0, 1), (2, 3), (4, 5), (6, 7)])


def test_issue_example_world8_sp2_rank0() -> None:
    """The data-parallel group of rank 0 in world 8 with sp 2, as each line's getter returns it."""
    upstream = expect(8, sequence_parallel_size=2)
    assert upstream.config["variant"] == "upstream"  # the default
    assert upstream.group_of(0, "dp") == (0, 2, 4, 6)
    assert "get_data_parallel_group()" in upstream.kind("dp").description
    assert upstream.group_of(0, "seq_dp") == tuple(range(8))
    assert upstream.kind("seq_dp").description.startswith("get_sequence_data_parallel_group()")
    habana = expect(8, sequence_parallel_size=2, variant="habana-2024")
    assert habana.group_of(0, "seq_dp") == tuple(range(8))
    assert "get_data_parallel_group()" in habana.kind("seq_dp").description
    assert "get_data_parallel_group()" not in habana.kind("dp").description.split(":")[0]
    assert habana.group_of(0, "dp") == (0, 2, 4, 6)  # built, but no getter returns it


def test_getters_named_per_variant() -> None:
    config = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "use_fp8": True,
              "use_distributed_optimizer": True}  # fmt: skip
    upstream = expect(8, **config)
    getters = {
        "dp": "get_data_parallel_group()",
        "dp:gloo": "get_data_parallel_group_gloo()",
        "sp": "get_sequence_parallel_group()",
        "seq_dp": "get_sequence_data_parallel_group()",
        "mp": "get_model_parallel_group()",
        "tp": "get_tensor_model_parallel_group()",
        "pp": "get_pipeline_model_parallel_group()",
        "embedding": "get_embedding_group()",
        "position_embedding": "get_position_embedding_group()",
        "amax": "get_amax_reduction_group()",
    }
    assert list(upstream.kinds()) == list(getters)  # in the order upstream creates them
    for kind, getter in getters.items():
        assert upstream.kind(kind).description.startswith(getter), kind
    habana = expect(8, **config, variant="habana-2024")
    assert list(habana.kinds()) == list(getters)
    for kind in ("dp:gloo", "tp", "pp", "embedding", "position_embedding", "amax"):
        assert "no getter" in habana.kind(kind).description, kind
    for kind in ("sp", "seq_dp", "mp"):
        assert habana.kind(kind).description.startswith(getters[kind]), kind
    # Same groups, kind by kind: the lines differ in getters and roles only.
    for kind in getters:
        assert habana.groups(kind) == upstream.groups(kind), kind


@pytest.mark.parametrize("variant", ["upstream", "habana-2024"])
def test_gloo_twins(variant: str) -> None:
    exp = expect(8, tensor_model_parallel_size=2, use_distributed_optimizer=True, variant=variant)
    twin = exp.kind("dp:gloo")
    assert twin.backends == ("gloo",)
    assert exp.kind("dp").backends == ()
    assert twin.groups() == Groups([(0, 2, 4, 6), (1, 3, 5, 7)]) == exp.groups("dp")
    # With Ulysses SP the twin stays the dp group without SP, in both lines (in the Habana
    # line, unlike the group get_data_parallel_group() returns).
    ulysses = expect(8, sequence_parallel_size=4, use_distributed_optimizer=True, variant=variant)
    assert ulysses.groups("dp:gloo") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])


@pytest.mark.parametrize(
    ("kind", "getter"),
    [
        ("dp:gloo", "get_data_parallel_group_gloo()"),  # use_distributed_optimizer=False
        ("amax", "get_amax_reduction_group()"),  # use_fp8=False
    ],
)
def test_group_not_made_is_upstreams_assertion(kind: str, getter: str) -> None:
    """Not made by default: upstream's getter asserts; the Habana line has no getter to ask."""
    upstream = expect(8, tensor_model_parallel_size=2)
    assert kind not in upstream.kinds()
    error = upstream.unavailable()[kind]
    assert error.upstream == "AssertionError"
    assert f"{getter} asserts" in str(error)
    habana = expect(8, tensor_model_parallel_size=2, variant="habana-2024")
    assert kind not in habana.kinds() and kind not in habana.unavailable()


def test_fp8_amax_groups() -> None:
    exp = expect(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, use_fp8=True)
    assert exp.groups("amax") == Groups([tuple(range(8)), tuple(range(8, 16))])


def test_split_rank_embeddings() -> None:
    exp = expect(16, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=2)
    assert exp.groups("embedding") == Groups([(0, 8, 12), (1, 9, 13), (2, 10, 14), (3, 11, 15)])
    assert exp.groups("position_embedding") == Groups([(0, 8), (1, 9), (2, 10), (3, 11)])
    # A split at the last stage is already in the embedding group; negatives index from the end.
    last = expect(16, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=-1)
    assert last.groups("embedding") == Groups([(0, 12), (1, 13), (2, 14), (3, 15)])
    assert last.groups("position_embedding") == Groups([(0, 12), (1, 13), (2, 14), (3, 15)])
    first = expect(16, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=0)
    assert first.groups("position_embedding") == Groups([(0,), (1,), (2,), (3,)])
    # With one stage both groups are the rank itself, whatever the split rank.
    single = expect(4, pipeline_model_parallel_split_rank=7)
    assert single.groups("embedding") == Groups([(0,), (1,), (2,), (3,)])
    assert single.kind("embedding").partition


def test_embedding_partition_flags() -> None:
    assert expect(8, pipeline_model_parallel_size=2).kind("embedding").partition
    assert not expect(8, pipeline_model_parallel_size=4).kind("embedding").partition
    three = expect(6, pipeline_model_parallel_size=3, pipeline_model_parallel_split_rank=1)
    assert three.kind("embedding").partition
    assert three.groups("embedding").is_partition_of(6)


def test_roles_per_variant() -> None:
    upstream = expect(8, sequence_parallel_size=2)
    assert dict(upstream.roles) == {
        "data_parallel": "dp",
        "gradient_reduce": "seq_dp",
        "tensor": "tp",
        "context": "sp",
        "pipeline": "pp",
        "embedding": "embedding",
        "loss": "dp",  # average_losses_across_data_parallel_group: get_data_parallel_group()
    }
    assert upstream.groups("gradient_reduce") == Groups([tuple(range(8))])
    assert upstream.groups("loss") == Groups([(0, 2, 4, 6), (1, 3, 5, 7)])
    habana = expect(8, sequence_parallel_size=2, variant="habana-2024")
    assert dict(habana.roles) == {**upstream.roles, "loss": "seq_dp"}
    assert habana.groups("loss") == Groups([tuple(range(8))])


@pytest.mark.parametrize(
    ("world", "config", "upstream", "message"),
    [
        (
            8,
            {"tensor_model_parallel_size": 3},
            "RuntimeError",
            r"world_size 8 is not divisible by tensor_model_parallel_size \(3\) × "
            r"pipeline_model_parallel_size \(1\) = 3",
        ),
        (
            8,
            {"tensor_model_parallel_size": 2, "sequence_parallel_size": 2},
            "AssertionError",
            "works only with tensor and pipeline parallel size 1, got tp=2, pp=1",
        ),
        (
            8,
            {"pipeline_model_parallel_size": 2, "sequence_parallel_size": 2},
            "AssertionError",
            "got tp=1, pp=2",
        ),
        (
            8,
            {"sequence_parallel_size": 3},
            "RuntimeError",
            "world_size 8 is not divisible by sequence_parallel_size 3",
        ),
        (
            8,
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "RuntimeError",
            "needs pipeline_model_parallel_size > 2 in Megatron-DeepSpeed, got 2",
        ),
        (
            8,
            {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": 4},
            "IndexError",
            r"not a stage of a 4-stage pipeline \(valid: 0..3\)",
        ),
        (
            8,
            {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": -5},
            "IndexError",
            "split_rank=-5",
        ),
        # 0 and negative degrees: what upstream's own arithmetic does with them.
        (8, {"tensor_model_parallel_size": 0}, "ZeroDivisionError", r"world_size % 0"),
        (8, {"pipeline_model_parallel_size": 0}, "ZeroDivisionError", "is 0"),
        (8, {"sequence_parallel_size": 0}, "ZeroDivisionError", r"8 // \(1 × 1 × 0\)"),
        (8, {"tensor_model_parallel_size": -3}, "RuntimeError", "not divisible"),
        (8, {"tensor_model_parallel_size": -1}, "AssertionError", r"get_data_parallel_group\(\)"),
        (8, {"pipeline_model_parallel_size": -2}, "AssertionError", "tp=1, pp=-2"),
        (8, {"sequence_parallel_size": -1}, "AssertionError", r"get_sequence_parallel_group\(\)"),
        (
            8,
            {"tensor_model_parallel_size": -2, "pipeline_model_parallel_size": -2},
            "TypeError",
            r"new_group\(\[\]\)",
        ),
        (
            8,
            {"tensor_model_parallel_size": -1, "sequence_parallel_size": -16},
            "ZeroDivisionError",
            "is 0",
        ),
        # The model-parallel loop (new_group([])) runs before the pipelines are indexed.
        (
            8,
            {
                "tensor_model_parallel_size": -1,
                "pipeline_model_parallel_size": 2,
                "sequence_parallel_size": -1,
                "pipeline_model_parallel_split_rank": 5,
            },
            "TypeError",
            "new_group",
        ),
    ],
)
@pytest.mark.parametrize("variant", ["upstream", "habana-2024"])
def test_errors(
    world: int, config: dict[str, Any], upstream: str, message: str, variant: str
) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        expect(world, **config, variant=variant)
    assert info.value.upstream == upstream


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"context_parallel_size": 2}, "takes no config key"),
        ({"sequence_parallel_size": "2"}, "must be an integer, got '2'"),
        ({"tensor_model_parallel_size": True}, "must be an integer, got True"),
        ({"pipeline_model_parallel_split_rank": 1.0}, "must be an integer"),
        ({"variant": "habana"}, "unknown megatron-deepspeed variant 'habana'"),
    ],
)
def test_meshsim_config_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        expect(8, **config)
    assert info.value.upstream is None  # meshsim's own check, not the framework's


def test_virtual_pipeline_needs_more_than_two_stages() -> None:
    exp = expect(8, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert exp.config["virtual_pipeline_model_parallel_size"] == 2
    # Megatron-LM accepts pp = 2 for the same config.
    meshsim.expect(
        "megatron", 8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )


@given(split_world())
def test_groups_equal_the_seed_loops(case: tuple[int, int, int, int]) -> None:
    world, tp, pp, sp = case
    for variant in ("upstream", "habana-2024"):
        exp = expect(
            world,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            sequence_parallel_size=sp,
            use_fp8=True,
            use_distributed_optimizer=True,
            variant=variant,
        )
        for kind, groups in loops(world, tp, pp, sp).items():
            assert exp.groups(kind) == Groups(groups), kind
            assert exp.groups(kind).is_partition_of(world), kind
        assert exp.groups("dp:gloo") == exp.groups("dp")


def test_equals_megatron_tp_dp_pp_for_every_world_up_to_64() -> None:
    checked = 0
    for world in range(1, 65):
        for tp, pp, _dp in ordered_factorizations(world, 3):
            ours = expect(
                world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_fp8=True
            )
            megatron = meshsim.expect(
                "megatron",
                world,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                order="tp-dp-pp",
            )
            for kind, theirs in SHARED.items():
                assert ours.groups(kind) == megatron.groups(theirs), (world, tp, pp, kind)
            assert ours.groups("seq_dp") == megatron.groups("dp-cp")
            checked += 1
    assert checked > 500


def test_configs() -> None:
    cases = list(megatron_deepspeed.configs(8))
    # per variant: tp × pp × dp factorizations (10), then sp in 2, 4, 8, then a split rank
    # and the flags off over a few of those
    assert len(cases) == 2 * (10 + 3 + 1 + 2)
    assert [c["variant"] for c in cases] == ["upstream"] * 16 + ["habana-2024"] * 16
    for case in cases:
        exp = expect(8, **case)
        flags = case["use_fp8"] and case["use_distributed_optimizer"]
        assert ({"amax", "dp:gloo"} <= set(exp.kinds())) == flags, case
    assert sum(not c["use_fp8"] for c in cases) == 2 * 2
    plain = list(megatron_deepspeed.configs(8, use_fp8=False, use_distributed_optimizer=False))
    assert all(not c["use_fp8"] and not c["use_distributed_optimizer"] for c in plain)
    assert len(list(megatron_deepspeed.configs(8, variant="habana-2024"))) == 16
    ids = [case.id for case in meshsim.layouts(4, "megatron-deepspeed")]
    assert any("variant=habana-2024" in i and "sp=4" in i for i in ids), ids


def test_refused_configs_raise_the_upstream_type() -> None:
    seen = []
    for config in megatron_deepspeed.refused_configs(8):
        with pytest.raises(LayoutError) as info:
            expect(8, **config)
        seen.append(info.value.upstream)
    per_variant = ["ZeroDivisionError", "ZeroDivisionError", "RuntimeError", "RuntimeError",
                   "AssertionError", "AssertionError", "AssertionError", "RuntimeError",
                   "IndexError"]  # fmt: skip
    assert seen == per_variant * 2


@pytest.mark.parametrize("world", [1, 2, 3, 6, 8, 12])
def test_refused_configs_are_refused_and_never_swept(world: int) -> None:
    refused = list(megatron_deepspeed.refused_configs(world))
    assert refused
    for config in refused:
        with pytest.raises(LayoutError):
            expect(world, **config)
    assert not [c for c in megatron_deepspeed.configs(world) if c in refused]
