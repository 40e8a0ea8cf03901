"""Config flags: value parsing, spec strings, translation rules; compare_groups properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshsim.cli import config_flags as cf
from meshsim.cli.compare import DIFFERENT, REORDERED, SAME, compare_groups
from meshsim.errors import LayoutError, UsageError
from meshsim.model.groups import Groups


@pytest.mark.parametrize(
    "text, value",
    [
        ("2", 2),
        ("-1", -1),
        ("none", None),
        ("True", True),
        ("off", False),
        ("2,4", (2, 4)),
        ("dp,tp", ("dp", "tp")),
        ("tensor=tp,context=cp", {"tensor": "tp", "context": "cp"}),
        ("[2, 4]", (2, 4)),
        ('{"tensor": "tp"}', {"tensor": "tp"}),
        ("tp-cp-ep-dp-pp", "tp-cp-ep-dp-pp"),
        ("flatten dp,cp -> dp_cp", "flatten dp,cp -> dp_cp"),
        ("hsdp", "hsdp"),
        ("0.5", 0.5),
    ],
)
def test_parse_value(text: str, value: object) -> None:
    assert cf.parse_value(text) == value


def test_bad_json_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cannot parse"):
        cf.parse_value("[2,")


def test_settings_and_specs() -> None:
    assert cf.parse_setting("pipeline-model-parallel-size=4") == ("pipeline_model_parallel_size", 4)
    assert cf.parse_setting("ops=flatten dp,cp") == ("ops", "flatten dp,cp")  # list items stay
    framework, settings_ = cf.split_spec("megatron:order=tp-cp-pp-ep-dp:context_parallel_size=2")
    assert framework == "megatron"
    assert settings_ == {"order": "tp-cp-pp-ep-dp", "context_parallel_size": 2}
    with pytest.raises(UsageError, match="key=value"):
        cf.split_spec("megatron:order")


def test_flag_names_follow_the_parameters() -> None:
    assert cf.flag("tensor_model_parallel_size") == "--tensor-model-parallel-size"
    assert cf.flag("use_data_before_expert_parallel_") == "--use-data-before-expert-parallel"
    assert cf.native_key("deepspeed", "tp") == "num_mp"
    assert cf.native_key("torchtitan", "dp_shard") == "dp_shard"
    assert cf.native_key("olmo-core", "dp_shard") == "shard_degree"
    assert cf.native_key("megatron", "dp") is None  # inferred
    assert cf.degree_of("megatron", "context_parallel_size") == "cp"


def test_translation_checks_a_given_dp() -> None:
    assert cf.translate("megatron", 16, {"tp": 2, "dp": 8}) == {"tensor_model_parallel_size": 2}
    with pytest.raises(LayoutError, match="dp must be 8"):
        cf.translate("megatron", 16, {"tp": 2, "dp": 4})
    with pytest.raises(LayoutError, match="dp_shard = 3 does not divide"):
        cf.translate("torchtitan", 16, {"dp_shard": 3})
    with pytest.raises(LayoutError, match="megatron-deepspeed has no expert-parallel degree"):
        cf.translate("megatron-deepspeed", 8, {"ep": 2})
    assert cf.translate("megatron-deepspeed", 8, {"ep": 1}) == {}


def _naive(a: Groups, b: Groups, world: int) -> tuple[str, int, int | None]:
    """Per-rank loop, the obvious way (reference for the vectorised version)."""
    members, exact = [], []
    for rank in range(world):
        ga, gb = a.group_of(rank), b.group_of(rank)
        members.append(
            (ga is None and gb is None)
            or (ga is not None and gb is not None and sorted(ga) == sorted(gb))
        )
        exact.append(ga == gb)
    if all(exact):
        return SAME, 0, None
    if all(members):
        bad = [r for r, ok in enumerate(exact) if not ok]
        return REORDERED, len(bad), bad[0]
    bad = [r for r, ok in enumerate(members) if not ok]
    return DIFFERENT, len(bad), bad[0]


@st.composite
def partitions(draw: st.DrawFn, world: int) -> Groups:
    size = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    perm = draw(st.permutations(range(world)))
    return Groups(np.array(perm, dtype=np.int64).reshape(-1, size))


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 6, 8, 12]))
def test_compare_groups_matches_a_per_rank_loop(data: st.DataObject, world: int) -> None:
    a = data.draw(partitions(world))
    b = data.draw(
        st.one_of(
            partitions(world),
            st.just(a),
            st.just(Groups(a.array[:, ::-1])),
            st.just(Groups(a.array[::-1])),
        )
    )
    assert compare_groups(a, b, world) == _naive(a, b, world)
