"""pytest11 entry point: meshsim's options, the ``meshsim`` marker and its runner.

``@pytest.mark.meshsim(world_size=[2, 4], backend=["threaded", "gloo"], timeout=60)`` turns one
test into one item per (backend, world size), ``test_x[gloo-4]``, whose body runs on every rank.
Imports nothing heavy: torch loads only when such an item actually runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from meshsim import options
from meshsim.fixtures import (  # noqa: F401 (fixtures)
    backend,
    meshsim_dataflow,
    meshsim_expected,
    meshsim_serial,
    rank,
    world_size,
)

CASE = "_meshsim_case"
DEFAULT_BACKEND = "threaded"
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT = 60.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshsim", "meshsim: run test bodies on N ranks")
    group.addoption(
        "--meshsim-backend",
        default=None,
        help="run every @pytest.mark.meshsim test on this backend (fake, threaded, gloo, nccl)",
    )
    group.addoption(
        "--meshsim-timeout",
        default=None,
        type=options.seconds("--meshsim-timeout", error=pytest.UsageError),
        help="per-test timeout in seconds for @pytest.mark.meshsim tests (overrides the marker)",
    )
    group.addoption(
        "--meshsim-max-world-size",
        default=None,
        type=options.integer(
            "--meshsim-max-world-size", minimum=1, error=pytest.UsageError, echo_text=True
        ),
        help="skip @pytest.mark.meshsim items whose world size exceeds this",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "meshsim(world_size=2, backend='threaded', timeout=60): run the test body on every rank; "
        "lists of world sizes or backends make one item each",
    )
    config.addinivalue_line(
        "markers",
        "meshsim_layout(framework, **config): the Expected the meshsim_expected fixture returns",
    )
    backend_option = config.getoption("--meshsim-backend")
    if backend_option is not None:
        from meshsim.harness.api import BACKENDS

        if backend_option not in BACKENDS:
            raise pytest.UsageError(
                f"--meshsim-backend {backend_option!r} is not a backend; "
                f"choose from {', '.join(BACKENDS)}"
            )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("meshsim")
    if marker is None:
        return
    if marker.args:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: pytest.mark.meshsim takes keywords only, e.g. "
            "@pytest.mark.meshsim(world_size=4, backend='gloo')"
        )
    unknown = set(marker.kwargs) - {"world_size", "backend", "timeout"}
    if unknown:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: pytest.mark.meshsim got unknown keywords "
            f"{sorted(unknown)}; it takes world_size, backend and timeout"
        )
    override = metafunc.config.getoption("--meshsim-backend")
    backends: Sequence[str] = (
        [override] if override else _as_list(marker.kwargs.get("backend", DEFAULT_BACKEND))
    )
    sizes: Sequence[int] = _as_list(marker.kwargs.get("world_size", DEFAULT_WORLD_SIZE))
    cases = [(b, int(w)) for b in backends for w in sizes]
    metafunc.fixturenames.append(CASE)
    metafunc.parametrize(CASE, cases, ids=[f"{b}-{w}" for b, w in cases])


def case_of(item: pytest.Item) -> tuple[str, int] | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get(CASE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    limit = config.getoption("--meshsim-max-world-size")
    if limit is None:
        return
    for item in items:
        case = case_of(item)
        if case is not None and case[1] > limit:
            item.add_marker(
                pytest.mark.skip(reason=f"world size {case[1]} > --meshsim-max-world-size {limit}")
            )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    case = case_of(pyfuncitem)
    if case is None:
        return None
    from meshsim.runner import run_test_body

    marker = pyfuncitem.get_closest_marker("meshsim")
    timeout = pyfuncitem.config.getoption("--meshsim-timeout") or (
        marker.kwargs.get("timeout") if marker else None
    )
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames}
    run_test_body(
        pyfuncitem.obj,
        kwargs,
        backend=case[0],
        world_size=case[1],
        timeout=timeout or DEFAULT_TIMEOUT,
    )
    return True


def pytest_assertrepr_compare(
    config: pytest.Config, op: str, left: object, right: object
) -> list[str] | None:
    """Explain ``assert observed == expected`` with the per-kind diff."""
    if op != "==":
        return None
    from meshsim.checks.diff import ObservedLayout, diff
    from meshsim.model.expected import Expected

    if isinstance(right, ObservedLayout) and isinstance(left, Expected):
        left, right = right, left
    if isinstance(left, ObservedLayout) and isinstance(right, Expected):
        found = diff(left, right)
        if found is not None:
            # pytest cuts an explanation at 8 lines / 640 characters (without -vv): the finding
            # first, then one line per differing kind.
            return [
                f"observed layout differs from the reference: {found.finding()}",
                *(f"  {found.kind_summary(kind)}" for kind in found.kinds()),
                "  (meshsim.diff(observed, expected) lists every rank's mismatch)",
            ]
    return None
