"""The data-flow recipes under the serial comparison (``meshsim verify F --equivalence``).

No false failure: every world-8 layout a recipe trains matches its serial twin unless the
reference records a framework finding for it (``find_violations``), in which case the
numbers must show it too. The default run keeps a sample on both tiers and the known
findings; the full sweep (about 300 layouts per tier) is marked slow.
"""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim import UsageError
from meshsim.dataflow.recipes import unsupported
from meshsim.model.invariants import find_violations
from meshsim.usage.recipe import check_equivalence
from tests.releases import needs_unflatten

FRAMEWORKS = ("olmo-core", "torchtitan", "accelerate", "lightning", "transformers", "verl")
_TT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

SAMPLE = [
    ("olmo-core", {"dp": "ddp", "cp": 2}),
    ("olmo-core", {"dp": "hsdp", "cp": 2, "tp": 2}),
    ("olmo-core", {"dp": "fsdp", "pp": 2, "cp": 2}),
    ("torchtitan", {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1, "ep": 1}),
    ("torchtitan", {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "pp": 2, "ep": 1}),
    ("accelerate", {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2, "distributed_type": "FSDP"}),
    ("lightning", {}),
    ("verl", {"ulysses_sequence_parallel_size": 2}),
]
#: Layouts whose framework trains replicas apart; the serial comparison must say so.
FINDINGS = [
    # verl#7493: FSDP1 over verl's (ddp, fsdp=1) mesh is NO_SHARD in one-rank groups.
    ("verl", {"fsdp_size": 1}, "not averaged over"),
    # accelerate 1.15 prepare_model skips DDP when tensor parallelism is on, while its loader
    # still hands the two tp groups different batches.
    (
        "accelerate",
        {"dp_shard_size": 2, "tp_size": 4, "distributed_type": "MULTI_GPU"},
        "no collective reduced it on this rank; the mean over dataloader_replica (2 ranks, the "
        "data_parallel group) is the serial value",
    ),
]


def _marks(framework: str) -> list[Any]:
    return [needs_unflatten] if framework == "torchtitan" else []


def _id(case: tuple[str, dict[str, Any]]) -> str:
    return case[0] + "-" + "-".join(f"{k}{v}" for k, v in case[1].items())


def _distinct() -> list[tuple[str, dict[str, Any]]]:
    """Every world-8 layout of the recipes' frameworks, torchtitan's by degrees of its current
    version (older versions and spmd backends name the same meshes differently)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for case in meshsim.layouts(8, list(FRAMEWORKS)):
        config = dict(case.config)
        if case.framework == "torchtitan":
            if config.get("version", "current") != "current" or config.get("etp", 1) != 1:
                continue
            config = {k: config[k] for k in _TT_KEYS if k in config}
        key = (case.framework, repr(sorted(config.items(), key=lambda kv: kv[0])))
        if key not in seen:
            seen.add(key)
            out.append((case.framework, config))
    return out


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c[0])) for c in SAMPLE], ids=_id)
def test_a_sampled_layout_matches_its_serial_twin(
    case: tuple[str, dict[str, Any]], backend: str
) -> None:
    framework, config = case
    assert not find_violations(meshsim.expect(framework, 8, **config))
    result = check_equivalence(framework, 8, backend, **config)
    assert result.passed, str(result)


@pytest.mark.parametrize("case", FINDINGS, ids=lambda c: _id(c[:2]) if isinstance(c, tuple) else c)
def test_a_framework_finding_shows_in_the_numbers(case: tuple[str, dict[str, Any], str]) -> None:
    framework, config, words = case
    result = check_equivalence(framework, 8, "threaded", **config)
    assert not result.passed
    lead = (result.error or "").splitlines()[0]
    assert lead.startswith("grad of `stage0.0.weight` at step 1 on ranks 0-7"), lead
    assert words in lead, lead


@needs_unflatten
@pytest.mark.parametrize(
    ("wiring", "words"),
    [
        ("sampler_over_gradient_mesh", "reduced over loss (4 ranks, the gradient_reduce group)"),
        ("wrapper_over_data_mesh", "reduced over batch (2 ranks, the data_parallel group); "
         "the mean over cp (2 ranks, the context group) is the serial value: not averaged "
         "over cp"),
        ("tp_different_seeds", "differs from the serial one"),
    ],
)  # fmt: skip
def test_each_classic_wrong_wiring_fails_the_comparison(wiring: str, words: str) -> None:
    config = {"dp_shard": 2, "cp": 2, "tp": 2}
    result = check_equivalence("torchtitan", 8, "threaded", wiring=wiring, **config)
    assert not result.passed
    assert words in (result.error or ""), result.error


def test_a_layout_the_recipe_does_not_train_is_refused_not_failed() -> None:
    with pytest.raises(UsageError, match="not DeepSpeed"):
        check_equivalence("accelerate", 8, "threaded", sp_size=2)
    with pytest.raises(UsageError, match=r"accelerate itself raises .* \(KeyError\)"):
        check_equivalence(
            "accelerate", 8, "threaded", dp_replicate_size=8, distributed_type="FSDP",
            version="1.10",
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_every_world_8_layout_matches_unless_the_framework_has_a_finding(backend: str) -> None:
    wrong: list[str] = []
    ran = 0
    for framework, config in _distinct():
        if unsupported(framework, config, backend, world_size=8):
            continue
        try:
            result = check_equivalence(framework, 8, backend, **config)
        except UsageError:
            continue  # a layout the recipe does not train (DeepSpeed, dispatch_batches)
        ran += 1
        finding = bool(find_violations(meshsim.expect(framework, 8, **config)))
        if result.passed == finding:
            verdict = "passed despite a finding" if finding else "failed"
            wrong.append(f"{_id((framework, config))} {verdict}: {result}")
    assert ran > 250
    assert not wrong, "\n".join(wrong[:10])
