"""Run a real-framework adapter on every rank of a gloo world and judge it against the reference."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from meshsim import expect
from meshsim.builders.real import EXTRAS, REAL_BUILDERS
from meshsim.checks import Observation, ObservedLayout, diff
from meshsim.errors import CollectiveDivergence, LayoutError
from meshsim.harness import run

#: Seconds per harness run: a hang guard only. The first build on a fresh worker imports the
#: framework (2-8 s alone; eight ranks importing at once on two loaded cores take far longer).
TIMEOUT = 600.0


def require(framework: str, module: str) -> pytest.MarkDecorator:
    """Skip a test module when ``module`` is not installed, without importing it here.

    ``pytest.importorskip`` would import the framework into the pytest process (2-8 s, and
    olmo_core/deepspeed write environment variables that harness workers then inherit); the
    ranks import it anyway, so a spec lookup is enough to decide.
    """
    found = importlib.util.find_spec(module.split(".")[0]) is not None
    reason = (
        f"{module} is not installed; pip install 'meshsim[{EXTRAS[framework]}]' "
        "(or bash ci/install_frameworks.sh) to run the real-framework adapter tests"
    )
    return pytest.mark.skipif(not found, reason=reason)


def adapter(framework: str) -> Any:
    return importlib.import_module(REAL_BUILDERS[framework])


def observe_real(framework: str, world: int, config: Mapping[str, Any]) -> list[Observation]:
    """Every rank's Observation of what the real framework built for ``config``."""
    build = adapter(framework).build
    return list(run(build, world, backend="gloo", timeout=TIMEOUT, args=(world, dict(config))))


def assert_matches(
    framework: str,
    world: int,
    config: Mapping[str, Any],
    *,
    unobserved: Iterable[str] = (),
) -> list[Observation]:
    """The real framework's groups equal the reference's, every kind it names, every rank.

    Every kind of the reference must have been observed (or recorded absent) except those in
    ``unobserved``, so an adapter cannot pass by skipping kinds.
    """
    observations = list(observe_real(framework, world, config))
    # Plain str names: a framework's enum (OLMo's MeshDimName) would make the caller import
    # the framework just to unpickle the Observation.
    names = [n for o in observations for n in (*o.groups, *o.absent)]
    assert {type(n) for n in names} <= {str}, {type(n) for n in names}
    expected = expect(framework, world, **config)
    seen = set(ObservedLayout.of(observations).names())
    missing = (set(expected.kinds()) | set(expected.unavailable())) - seen - set(unobserved)
    assert not missing, f"the adapter observed no group for kinds {sorted(missing)}"
    found = diff(observations, expected)
    assert found is None, str(found)
    return observations


def _build_or_refusal(framework: str, world: int, config: Mapping[str, Any]) -> tuple[str, ...]:
    """On a rank: ``("built",)`` or ``("refused", exception type, upstream type, message)``."""
    try:
        adapter(framework).build(world, config)
    except Exception as error:
        upstream = getattr(error, "upstream", None) or type(error).__name__
        return ("refused", type(error).__name__, upstream, str(error))
    return ("built",)


def real_outcomes(
    framework: str, world: int, config: Mapping[str, Any], *, diverging: bool = False
) -> list[tuple[str, ...]]:
    """What each rank's adapter did: built, or refused (with the framework's exception type).

    ``diverging=True``: some ranks refuse while the others go on creating groups. The harness
    rightly calls that a ``CollectiveDivergence`` (a real job would hang or crash there); every
    rank still returned, so the per-rank answers are read from the error.
    """
    try:
        return list(
            run(
                _build_or_refusal,
                world,
                backend="gloo",
                timeout=TIMEOUT,
                args=(framework, world, config),
            )
        )
    except CollectiveDivergence as divergence:
        if not diverging:
            raise
        assert all(o.ok for o in divergence.outcomes), divergence
        return [o.value for o in divergence.outcomes]


def assert_refused_alike(framework: str, world: int, config: Mapping[str, Any]) -> str:
    """Both the reference and the real framework (on every rank) reject ``config``, with the
    same exception type; returns the framework's message."""
    with pytest.raises(LayoutError) as reference:
        expect(framework, world, **config)
    outcomes = real_outcomes(framework, world, config)
    assert all(o[0] == "refused" for o in outcomes), outcomes
    upstreams = {o[2] for o in outcomes}
    assert upstreams == {reference.value.upstream}, (upstreams, str(reference.value))
    return outcomes[0][3]


def _environment_changes(framework: str, world: int, config: Mapping[str, Any]) -> list[str]:
    import os

    before = dict(os.environ)
    adapter(framework).build(world, config)
    return sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))


def environment_changes(framework: str, world: int, config: Mapping[str, Any]) -> list[str]:
    """Variables a build changed on any rank: the harness discards such a (then cold) worker."""
    per_rank = run(
        _environment_changes,
        world,
        backend="gloo",
        timeout=TIMEOUT,
        args=(framework, world, config),
    )
    return sorted({name for changed in per_rank for name in changed})


def case_id(value: Any) -> str:
    """A stable pytest id (same in every xdist worker): callables by name, no addresses."""
    if isinstance(value, Mapping):
        return ",".join(f"{key}={case_id(item)}" for key, item in value.items()) or "default"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(case_id(item) for item in value) + "]"
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return str(value)
