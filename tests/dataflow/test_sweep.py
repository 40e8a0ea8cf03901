"""The data-flow recipe over world-8 layouts of olmo-core and torchtitan: every one passes.

The full sweep (every distinct layout, on gloo) is slow; the default run keeps a sample that
covers FSDP, DDP, HSDP, CP, TP and PP.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshsim import UsageError, layouts
from meshsim.dataflow.recipes import _hsdp, check_dataflow, unsupported
from tests.releases import needs_unflatten

_TT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def _distinct() -> list[tuple[str, dict[str, Any]]]:
    """Every world-8 layout; torchtitan's by degrees of the current version (its spmd_backend and
    older versions name the same meshes differently, the data flow is the same)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for case in layouts(8, ["olmo-core", "torchtitan"]):
        config = dict(case.config)
        if case.framework == "torchtitan":
            if config.get("version", "current") != "current" or config.get("etp", 1) != 1:
                continue
            config = {k: config[k] for k in _TT_KEYS if k in config}
        key = (case.framework, repr(sorted(config.items())))
        if key not in seen:
            seen.add(key)
            out.append((case.framework, config))
    return out


ALL = _distinct()
SAMPLE = [
    ("olmo-core", {"dp": "ddp", "cp": 2}),
    ("olmo-core", {"dp": "fsdp", "pp": 2, "cp": 2}),
    ("torchtitan", {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2, "pp": 2, "ep": 1}),
    ("torchtitan", {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "pp": 2, "ep": 2}),
]


def _id(case: tuple[str, dict[str, Any]]) -> str:
    return case[0] + "-" + "-".join(f"{k}{v}" for k, v in case[1].items())


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[needs_unflatten] if c[0] == "torchtitan" else []) for c in SAMPLE],
    ids=_id,
)
def test_sample_passes_on_threaded(case: tuple[str, dict[str, Any]]) -> None:
    framework, config = case
    assert unsupported(framework, config, "threaded") is None
    result = check_dataflow(framework, 8, "threaded", **config)
    assert result.passed, str(result)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "threaded"])
@pytest.mark.parametrize("case", ALL, ids=_id)
def test_every_world8_layout_passes(case: tuple[str, dict[str, Any]], backend: str) -> None:
    """threaded as gloo: each threaded rank draws from its own generator, so HSDP is exact
    there too (it was refused on threaded before)."""
    framework, config = case
    reason = unsupported(framework, config, backend, world_size=8)  # dp_shard=-1 inferred
    if reason is not None:
        pytest.skip(reason)
    result = check_dataflow(framework, 8, backend, **config)
    assert result.passed, str(result)


def test_ddp_over_a_tp_model_is_skipped_with_the_reason() -> None:
    with pytest.raises(UsageError, match="no DTensor sharding strategy"):
        check_dataflow("olmo-core", 8, "gloo", dp="ddp", tp=2)
    # torchtitan replicates without sharding (DDP) when dp_shard and cp are 1
    ddp_tp = {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 4, "pp": 1, "ep": 1}
    assert "torchtitan's DDP" in (unsupported("torchtitan", ddp_tp, "gloo") or "")
    assert unsupported("torchtitan", {**ddp_tp, "cp": 2, "tp": 2}, "gloo") is None  # FSDP2


@needs_unflatten
def test_the_sweep_covers_both_conventions_and_hsdp() -> None:
    assert {f for f, _ in ALL} == {"olmo-core", "torchtitan"}
    assert any(_hsdp(f, c) for f, c in ALL)
    assert all(c in ALL for c in SAMPLE)
