"""The check can fail: a builder that deviates from its convention is caught, by kind and rank."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest

import meshsim
import meshsim.builders.olmo_core as olmo_builder
from meshsim.builders import build
from meshsim.builders.megatron import build as megatron_build
from meshsim.checks import assert_layout, diff
from meshsim.errors import LayoutMismatch
from meshsim.verify import verify
from tests.builders import _wrong
from tests.builders._ranks import build_every_rank

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")

TP2_PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def test_megatron_built_in_another_order_is_a_mismatch_naming_kinds_and_ranks() -> None:
    observed = build_every_rank("megatron", 16, {**TP2_PP2, "order": "tp-pp-dp"})
    expected = meshsim.expect("megatron", 16, **TP2_PP2)  # default order tp-cp-ep-dp-pp
    found = diff(observed, expected)
    assert found is not None
    bad = {m.kind for m in found.mismatches}
    assert {"dp", "pp", "dp-cp", "tp-pp", "embedding"} <= bad
    assert "tp" not in bad and "cp" not in bad  # tp stays fastest in both orders
    text = "\n".join(found.lines(limit=len(found.mismatches)))
    assert re.search(r"pp: rank 2 holds? \(0, 2\); expected \(2, 10\)", text)
    assert "dp: ranks 0, 4 hold (0, 4, 8, 12); expected (0, 2, 4, 6)" in text
    with pytest.raises(LayoutMismatch, match=r"dp-cp: ranks 0, 4 hold \(0, 4, 8, 12\)"):
        assert_layout(observed, expected)


def test_deepspeed_moe_layouts_differ_only_in_expert_kinds() -> None:
    moe = {"num_mp": 2, "ep": 4, "enable_expert_tensor_parallelism": True}
    observed = build_every_rank("deepspeed", 16, {**moe, "use_data_before_expert_parallel_": True})
    found = diff(observed, meshsim.expect("deepspeed", 16, **moe))
    assert found is not None
    assert {m.kind for m in found.mismatches} == {"expert", "expert_data"}
    assert "expert: ranks 0, 4 hold (0, 4, 8, 12); expected (0, 2, 4, 6)" in str(found)


def test_olmo_hsdp_split_mismatch() -> None:
    observed = build_every_rank("olmo-core", 8, {"dp": "hsdp", "num_replicas": 4})
    found = diff(observed, meshsim.expect("olmo-core", 8, dp="hsdp", num_replicas=2))
    assert found is not None
    assert {"dp_shard", "dp_replicate", "get_ep_mesh"} <= {m.kind for m in found.mismatches}
    assert "get_dp_mesh" not in {m.kind for m in found.mismatches}  # all 8 ranks either way


def test_getter_that_should_raise_but_builds_is_unexpected(monkeypatch: pytest.MonkeyPatch) -> None:
    # A builder that ignores OLMo's fold of dp_shard into dp_cp under HSDP + CP.
    getters = {**olmo_builder.GETTERS, "get_dp_shard_mesh": lambda root: root["dp_shard"]}
    monkeypatch.setattr(olmo_builder, "GETTERS", getters)
    config = {"dp": "hsdp", "num_replicas": 2, "cp": 2}
    found = diff(build_every_rank("olmo-core", 8, config), meshsim.expect("olmo-core", 8, **config))
    assert found is not None
    assert {(m.kind, m.aspect) for m in found.mismatches} == {("get_dp_shard_mesh", "unexpected")}
    assert "could not determine" in str(found)


def test_getter_that_raises_but_should_not_is_a_members_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(root: Any) -> Any:
        raise RuntimeError("could not determine tensor parallel sub-mesh")

    monkeypatch.setattr(olmo_builder, "GETTERS", {**olmo_builder.GETTERS, "get_tp_mesh": broken})
    config = {"dp": "fsdp", "tp": 2}
    found = diff(build_every_rank("olmo-core", 4, config), meshsim.expect("olmo-core", 4, **config))
    assert found is not None
    assert "get_tp_mesh: ranks 0, 1 hold no group; expected (0, 1)" in str(found)


# -- verify's verdicts on wrong builders (fake tier through the harness) -------------------------
@pytest.fixture
def wrong(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route every framework to tests.builders._wrong; returns a setter for its behaviour."""
    import meshsim.verify as verify_module

    monkeypatch.setattr(
        verify_module, "BUILDERS", {f: "tests.builders._wrong" for f in meshsim.CONVENTIONS}
    )

    def set_behaviour(fn: Any) -> None:
        monkeypatch.setattr(_wrong, "BEHAVIOUR", fn)

    return set_behaviour


def test_verify_reports_a_diff(wrong: Any) -> None:
    wrong(lambda world, cfg: megatron_build(world, {**cfg, "order": "tp-pp-dp"}))
    result = verify("megatron", 8, "fake", **TP2_PP2)
    assert not result.passed and result.error is None and result.diff is not None
    assert "pp" in {m.kind for m in result.diff.mismatches}
    assert "FAIL" in str(result)


def test_verify_builder_raises_on_accepted_config(wrong: Any) -> None:
    def refuse(world: int, cfg: Mapping[str, Any]) -> Any:
        raise RuntimeError("world_size (8) is not divisible by 4")

    wrong(refuse)
    result = verify("megatron", 8, "fake", **TP2_PP2)
    assert not result.passed
    assert "raised RuntimeError" in (result.error or "") and "accepts" in (result.error or "")


def test_verify_builder_builds_rejected_config(wrong: Any) -> None:
    wrong(lambda world, cfg: build("megatron", world, {}))
    result = verify("megatron", 8, "fake", tensor_model_parallel_size=3)
    assert not result.passed and "reference rejects" in (result.error or "")


def test_verify_builder_bug_on_rejected_config_is_not_a_pass(wrong: Any) -> None:
    def crash(world: int, cfg: Mapping[str, Any]) -> Any:
        return len(world)  # TypeError: a builder bug, not a framework's refusal

    wrong(crash)
    result = verify("megatron", 8, "fake", tensor_model_parallel_size=3)
    assert not result.passed and "builder bug" in (result.error or "")


def test_verify_rejection_with_another_exception_type_fails(wrong: Any) -> None:
    def refuse(world: int, cfg: Mapping[str, Any]) -> Any:
        raise KeyError("tp")

    wrong(refuse)
    result = verify("megatron", 8, "fake", tensor_model_parallel_size=3)  # upstream RuntimeError
    assert not result.passed
    assert "reference says the framework raises RuntimeError" in (result.error or "")
