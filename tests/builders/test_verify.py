"""verify and verify_many through the harness: fake, threaded, gloo, rejections, real hook."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import meshsim
from meshsim.builders import build
from meshsim.errors import UsageError
from meshsim.model.sweep import LayoutCase
from meshsim.verify import VerifyResult, verify, verify_case, verify_many
from tests.builders._ranks import release_refusal
from tests.builders.cases import REJECTED, VALID

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")

#: One world-4 case per convention, each with something that needs a real collective to prove:
#: a 2-D OLMo mesh, new_group embedding groups, an unflattened torchtitan view, MoE groups.
WORLD4: list[tuple[str, dict[str, Any]]] = [
    ("torch", {"mesh_shape": (2, 2), "mesh_dim_names": ("dp", "tp"), "ops": ["flatten dp,tp"]}),
    ("olmo-core", {"dp": "hsdp", "num_replicas": 2, "cp": 1}),
    ("torchtitan", {"dp_shard": 2, "tp": 2, "ep": 2}),
    ("megatron", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    ("megatron-deepspeed", {"pipeline_model_parallel_size": 4}),
    ("deepspeed", {"num_pp": 2, "ep": 2}),
]
CASES4 = [LayoutCase(fw, 4, cfg) for fw, cfg in WORLD4]


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_verify_many_on_communicating_tiers(backend: str) -> None:
    results = list(verify_many(CASES4, backend, timeout=60))
    assert [r.framework for r in results] == [c.framework for c in CASES4]
    for case, result in zip(CASES4, results):
        assert result.passed, str(result)
        assert result.backend == backend and result.seconds > 0
        # a release without a feature the case needs (torch < 2.10: _unflatten) rejects it alike
        refused = release_refusal(case.framework, case.world_size, case.config) is not None
        assert bool(result.rejected) == refused and bool(result.kinds_checked) != refused


def test_every_representative_case_through_the_fake_harness() -> None:
    # The harness's fake tier also checks that every rank creates the same groups in the same
    # order (a real backend would hang otherwise), which the plain rank loop does not.
    results = list(verify_many([LayoutCase(*case) for case in VALID + REJECTED], "fake"))
    failed = [str(r) for r in results if not r.passed]
    assert not failed, "\n".join(failed)
    refused = [release_refusal(*case) is not None for case in VALID]  # by this torch release
    assert [r.rejected is not None for r in results] == refused + [True] * len(REJECTED)


def test_groups_are_proven_by_all_gathers_on_threaded_tier() -> None:
    from meshsim.harness import run

    def body() -> Any:
        return build("olmo-core", 4, {"dp": "hsdp", "num_replicas": 2})

    observations = run(body, 4, backend="threaded", timeout=60)
    for obs in observations:
        for view in obs.groups.values():
            assert view.gathered == view.members, view  # 1-D groups and the 2-D dp mesh alike
    assert observations[3].groups["get_dp_mesh"].mesh == [[0, 1], [2, 3]]


def test_verify_fake_tier_and_rejections() -> None:
    ok = verify("megatron", 16, "fake", tensor_model_parallel_size=2, context_parallel_size=2)
    assert isinstance(ok, VerifyResult) and ok.passed and ok.rejected is None
    assert {"dp", "dp-cp", "cp", "embedding", "expert:ep"} <= set(ok.kinds_checked)
    refused = verify("olmo-core", 8, "fake", dp="ddp", ep=2)
    assert refused.passed and refused.diff is None
    assert refused.rejected is not None and "HSDP" in refused.rejected
    assert "rejected by both" in str(refused)


def test_rejection_on_gloo_passes() -> None:
    result = verify("megatron", 4, "gloo", timeout=60, tensor_model_parallel_size=3)
    assert result.passed and result.rejected is not None and "RuntimeError" in result.rejected


def test_verify_many_fake_batches_keep_case_order() -> None:
    cases = [
        *meshsim.layouts(4, "megatron-deepspeed"),
        LayoutCase("deepspeed", 8, {"num_pp": 2, "num_mp": 2, "num_dp": 4}),  # rejected
        *meshsim.layouts(8, "deepspeed", moe=False)[:5],
        LayoutCase("torch", 2, {}),
    ]
    results = list(verify_many(cases, "fake"))
    assert [(r.framework, r.world_size, r.config) for r in results] == [
        (c.framework, c.world_size, c.config) for c in cases
    ]
    assert all(r.passed for r in results), [str(r) for r in results if not r.passed]
    assert [r.rejected is not None for r in results].count(True) == 1


def test_verify_case_and_sampled_ranks() -> None:
    assert verify_case(LayoutCase("torchtitan", 8, {"cp": 2, "tp": 2}), "fake").passed
    sampled = verify(
        "megatron",
        64,
        "fake",
        ranks=[0, 37, 63],
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=4,
    )
    assert sampled.passed and "pp" in sampled.kinds_checked


def test_real_framework_hook_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshsim.builders import real
    from meshsim.model import torch_release

    monkeypatch.setattr(torch_release, "installed", lambda: (2, 13))  # in OLMo-core's range
    adapters = {**real.REAL_BUILDERS, "megatron": "meshsim.builders.real.no_such_adapter"}
    monkeypatch.setattr(real, "REAL_BUILDERS", adapters)
    with pytest.raises(
        UsageError, match=r"real\.no_such_adapter.*pip install 'meshsim\[megatron\]'"
    ):
        verify("megatron", 4, "fake", real=True)
    monkeypatch.setattr(real, "REQUIRES", {**real.REQUIRES, "olmo-core": ("no_such_olmo",)})
    with pytest.raises(UsageError, match=r"no_such_olmo.*pip install 'meshsim\[olmo-core\]'"):
        verify("olmo-core", 4, "fake", real=True, dp="fsdp")
    with pytest.raises(UsageError, match=r"drop --real \(real=False\)"):
        verify("torch", 4, "fake", real=True)
    with pytest.raises(UsageError, match="no adapter that runs the real megatron-deepspeed"):
        verify("megatron-deepspeed", 8, "fake", real=True)


@pytest.mark.parametrize(
    ("release", "refused"), [((2, 15), True), ((2, 9), True), ((2, 13), False)]
)
def test_real_olmo_core_outside_its_torch_range_says_why(
    monkeypatch: pytest.MonkeyPatch, release: tuple[int, int], refused: bool
) -> None:
    """ai2-olmo-core 3.0.0 declares torch>=2.10,<2.14: under torch 2.15 pip cannot install it,
    and the usage error says so instead of suggesting an install that fails."""
    from meshsim.builders import real
    from meshsim.model import torch_release

    monkeypatch.setattr(torch_release, "installed", lambda: release)
    monkeypatch.setattr(real, "REQUIRES", {**real.REQUIRES, "olmo-core": ("no_such_olmo",)})
    expected = r"torch>=2\.10,<2\.14 and this is torch" if refused else r"pip install 'meshsim"
    with pytest.raises(UsageError, match=expected):
        verify("olmo-core", 4, "fake", real=True, dp="fsdp")


def test_unknown_framework_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown framework 'jax'"):
        verify("jax", 4, "fake")


def test_importing_verify_does_not_import_torch() -> None:
    code = "import sys, meshsim, meshsim.verify, meshsim.builders; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("framework", sorted(meshsim.CONVENTIONS))
def test_a_sample_of_every_sweep_of_world_8_on_the_fake_tier(framework: str) -> None:
    # Every 9th valid config (all of them: ``meshsim sweep -n 8 --backend fake``, ~1 min).
    results = list(verify_many(meshsim.layouts(8, framework)[::9], "fake"))
    failed = [str(r) for r in results if not r.passed]
    assert results and not failed, "\n".join(failed[:5])
