"""torchtitan's getter kinds from a pattern's plan equal the kinds asked call by call.

``_torchtitan_plan`` answers the first layout of a pattern through ``_torchtitan_api`` and
each later one by re-slicing the views the plan names; every kind must come out the same,
error messages and group rows included, under each torch release's slicing rule.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from meshsim.errors import LayoutError
from meshsim.model import layout as layout_module
from meshsim.model.conventions import _torchtitan_api as api
from meshsim.model.conventions import _torchtitan_plan as plan
from meshsim.model.conventions import torchtitan as tt
from meshsim.model.expected import Kind


def _views(world: int, config: dict[str, object]) -> api._Views:
    version, backend, raw, ulysses = tt._parse(config)
    assert backend is not None
    return tt._views(version, backend, tt._degrees(world, version, raw, ulysses))


def _configs(world: int, every: int = 1) -> Iterator[dict[str, object]]:
    for config in list(tt.configs(world, versions=("current",)))[::every]:
        for backend in ("spmd_types", "full_dtensor", "partial_dtensor"):
            yield {**config, "spmd_backend": backend}


def _facts(kind: Kind) -> tuple[object, ...]:
    """Everything a check reads of a kind."""
    if isinstance(kind.source, LayoutError):
        outcome: object = ("raises", str(kind.source), kind.source.upstream)
    else:
        rows = kind.groups().array
        outcome = (rows.shape, rows.tobytes())
    return (
        kind.name, kind.description, outcome, kind.partition, kind.keyed_by_first,
        kind.mesh_dims, kind.mesh_shape, kind.backends, kind.derived,
    )  # fmt: skip


def _differences(world: int, every: int = 1) -> tuple[list[str], int]:
    """Kinds the plan gets wrong over every current config of ``world``, and how many
    layouts it answered from a plan."""
    plan._PLANS.clear()
    wrong: list[str] = []
    followed = 0
    for config in _configs(world, every):
        if plan._pattern(_views(world, config)) in plan._PLANS:
            followed += 1
        planned = plan.api_kinds(_views(world, config))
        direct = api.api_kinds(_views(world, config))
        assert list(planned) == list(direct), config
        wrong += [
            f"{config}: {name}" for name in direct if _facts(planned[name]) != _facts(direct[name])
        ]
    return wrong, followed


@pytest.mark.parametrize(
    ("world", "every", "release"),
    # Under 2.10-2.12 every size is part of the pattern: few layouts repeat one.
    [(8, 1, "newest"), (16, 1, "newest"), (64, 7, "newest"), (8, 1, "2.11")],
)
def test_planned_kinds_equal_the_kinds_asked_call_by_call(
    world: int, every: int, release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHSIM_TORCH_RELEASE", release)
    wrong, followed = _differences(world, every)
    assert wrong == []
    assert followed > 0  # most layouts came from a plan, so the comparison tested one


def test_a_pattern_without_the_size_1_axes_gives_wrong_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above can fail: a pattern that forgets which axes have size 1 shares plans
    between layouts whose getters answer differently, and the comparison says so."""
    real = plan._pattern

    def forgetful(views: api._Views) -> object:
        version, backend, rule, meshes, axes = real(views)  # type: ignore[misc]
        return version, backend, rule, tuple(m[:4] for m in meshes), axes

    monkeypatch.setattr(plan, "_pattern", forgetful)
    wrong, _ = _differences(8)
    assert wrong


def test_every_plan_is_kept_once_per_pattern() -> None:
    plan._PLANS.clear()
    configs = list(_configs(16))
    for config in configs:
        plan.api_kinds(_views(16, config))
    assert 0 < len(plan._PLANS) < len(configs) / 2
    assert all(p is not None for p in plan._PLANS.values())


def test_a_refused_kind_raises_a_fresh_traceback_each_time() -> None:
    """Layouts of one pattern share its refused kinds: raising one must not pile up frames."""
    kinds = plan.api_kinds(_views(8, {"dp_shard": 8}))
    refused = next(k for k in kinds.values() if isinstance(k.source, LayoutError))
    depths = []
    for _ in range(3):
        with pytest.raises(LayoutError) as caught:
            refused.groups()
        tb, depth = caught.value.__traceback__, 0
        while tb is not None:
            tb, depth = tb.tb_next, depth + 1
        depths.append(depth)
    assert depths[0] == depths[1] == depths[2]
    assert np.array_equal(kinds["world_mesh"].groups().array, np.arange(8)[None, :])


def test_threads_sharing_the_kept_answers_get_the_same_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threaded ranks build their references side by side: plans and slice verdicts are
    shared and forgotten (here after 2 and 8 of them) while other threads read them."""
    monkeypatch.setattr(plan, "KEPT_PLANS", 2)
    monkeypatch.setattr(layout_module, "_KEPT_VERDICTS", 8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    configs = list(_configs(8))[::4]
    wanted = [{n: _facts(k) for n, k in api.api_kinds(_views(8, c)).items()} for c in configs]
    wrong: list[str] = []

    def build() -> None:
        try:
            for config, kinds in zip(configs, wanted):
                got = {n: _facts(k) for n, k in plan.api_kinds(_views(8, config)).items()}
                if got != kinds:
                    wrong.append(str(config))
        except Exception as error:  # a cache read racing an eviction
            wrong.append(repr(error))

    try:
        threads = [threading.Thread(target=build) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []
