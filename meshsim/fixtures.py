"""Fixtures the meshsim plugin exposes to every test suite that has meshsim installed.

* ``rank``, ``world_size``, ``backend``: inside a ``@pytest.mark.meshsim`` test body, the rank
  the body runs as, the world size and the backend of this item.
* ``meshsim_expected``: the :class:`meshsim.Expected` of the layout a test is parametrized
  with (a :class:`meshsim.LayoutCase` parameter named ``layout_case``, see
  :func:`parametrize_layouts`) or marked with ``@pytest.mark.meshsim_layout(framework, **config)``.
* :func:`parametrize_refusals`: one item per config a framework rejects, with its type.
* :func:`distributed_fixture`: state built once on N ranks (a checkpoint written by 8 ranks, a
  sharded dataset) and shared by several tests, as DeepSpeed's ``DistributedFixture``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from meshsim.model.expected import Expected
from meshsim.model.sweep import LayoutCase, layouts, refused_configs

#: What the ``rank`` fixture holds in the parent process, before a rank substitutes itself.
RANK_PLACEHOLDER = -1


def _case(request: pytest.FixtureRequest) -> tuple[str, int]:
    callspec = getattr(request.node, "callspec", None)
    case = None if callspec is None else callspec.params.get("_meshsim_case")
    if case is None:
        raise pytest.UsageError(
            f"fixture {request.fixturename!r} only exists in @pytest.mark.meshsim tests "
            f"({request.node.nodeid} has no such marker)"
        )
    return case  # type: ignore[no-any-return]


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """The rank this copy of the test body runs as (substituted on each rank)."""
    _case(request)
    return RANK_PLACEHOLDER


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The world size of this ``@pytest.mark.meshsim`` item."""
    return _case(request)[1]


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The backend (fake, threaded, gloo, nccl) of this ``@pytest.mark.meshsim`` item."""
    return _case(request)[0]


@pytest.fixture
def meshsim_expected(request: pytest.FixtureRequest) -> Expected:
    """The reference groups of this test's layout."""
    callspec = getattr(request.node, "callspec", None)
    params: dict[str, Any] = {} if callspec is None else callspec.params
    case = params.get("layout_case")
    if isinstance(case, LayoutCase):
        return case.expect()
    marker = request.node.get_closest_marker("meshsim_layout")
    if marker is None:
        raise pytest.UsageError(
            f"{request.node.nodeid}: meshsim_expected needs a 'layout_case' parameter "
            "(meshsim.fixtures.parametrize_layouts) or "
            "@pytest.mark.meshsim_layout(framework, **config)"
        )
    from meshsim.errors import LayoutError
    from meshsim.model.conventions import expect

    config = dict(marker.kwargs)
    size = config.pop("world_size", None)
    if size is None:
        size = _case(request)[1]
    # A value may be a function of the item's world size, so one marker follows a parametrised
    # world_size=[4, 8]: mesh_shape=lambda n: (2, n // 2).
    config = {key: value(size) if callable(value) else value for key, value in config.items()}
    try:
        return expect(marker.args[0], size, **config)
    except LayoutError as error:  # one line naming the cause, not the fixture's source
        shown = ", ".join([repr(marker.args[0]), *(f"{k}={v!r}" for k, v in config.items())])
        problem = f"meshsim_layout({shown}) at world_size={size}: {error}"
    pytest.fail(problem, pytrace=False)


def parametrize_layouts(
    world_size: int, framework: str | list[str] | None = None, **options: Any
) -> Any:
    """``@parametrize_layouts(8, "megatron")``: one test item per valid layout, readable ids.

    The test takes a ``layout_case`` argument (a :class:`meshsim.LayoutCase`) and may use the
    ``meshsim_expected`` fixture. ``options`` go to the convention's enumeration, e.g.
    ``parametrize_layouts(8, "torch", mesh_dim_names=("dp", "tp"))`` for 2-D meshes only.
    """
    cases = layouts(world_size, framework, **options)
    return pytest.mark.parametrize("layout_case", cases, ids=[c.id for c in cases])


def parametrize_refusals(world_size: int, framework: str | list[str] | None = None) -> Any:
    """``@parametrize_refusals(8, "olmo-core")``: one test item per config the framework rejects.

    The test takes a ``refused_case`` argument (a :class:`meshsim.RefusedCase`): its
    ``config``, and ``error().upstream``, the exception type the framework raises. The other
    half of :func:`parametrize_layouts`: a builder should refuse these the framework's way.
    """
    cases = refused_configs(world_size, framework)
    return pytest.mark.parametrize("refused_case", cases, ids=[c.id for c in cases])


@pytest.fixture
def meshsim_dataflow(request: pytest.FixtureRequest, meshsim_expected: Expected) -> Any:
    """Data-flow checks against this test's reference, callable on every rank."""
    from meshsim.dataflow.probe import DataflowProbe

    return DataflowProbe(meshsim_expected, _case(request)[0])


@pytest.fixture
def meshsim_serial(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """:func:`meshsim.assert_matches_serial` bound to this test's layout and backend.

    Mark the test ``@pytest.mark.meshsim_layout(framework, world_size=N, **config)`` (not
    ``@pytest.mark.meshsim``: the check runs the ranks itself, from the test's own process)
    and call ``meshsim_serial(step, batch=..., steps=...)``. The backend is
    ``--meshsim-backend`` when given, else ``threaded``; ``backend=`` overrides both.
    """
    from meshsim.usage.serial import assert_matches_serial

    if request.node.get_closest_marker("meshsim") is not None:
        raise pytest.UsageError(
            f"{request.node.nodeid}: meshsim_serial runs the ranks itself; drop "
            "@pytest.mark.meshsim and give the world in @pytest.mark.meshsim_layout("
            "framework, world_size=N, ...)"
        )
    marker = request.node.get_closest_marker("meshsim_layout")
    if marker is None or "world_size" not in marker.kwargs:
        raise pytest.UsageError(
            f"{request.node.nodeid}: meshsim_serial needs "
            "@pytest.mark.meshsim_layout(framework, world_size=N, **config)"
        )
    expected = request.getfixturevalue("meshsim_expected")
    default = request.config.getoption("--meshsim-backend", None) or "threaded"

    def check(step: Callable[..., Any], **options: Any) -> Any:
        __tracebackhide__ = True
        options.setdefault("backend", default)
        return assert_matches_serial(step, expected.world_size, expected, **options)

    return check


class PerRank(tuple):  # type: ignore[type-arg]
    """One value per rank, from a :func:`distributed_fixture`.

    A plain tuple in the test itself (``state[3]`` is rank 3's); inside a
    ``@pytest.mark.meshsim`` body each rank receives its own rank's value instead.
    """

    __slots__ = ()

    def for_rank(self, rank: int, world_size: int) -> Any:
        if len(self) != world_size:
            raise pytest.UsageError(
                f"a distributed_fixture built on {len(self)} ranks was passed to a body running "
                f"on {world_size}; build it with world_size={world_size}"
            )
        return self[rank]


def distributed_fixture(
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    scope: str = "module",
    name: str | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Turn a rank body into a fixture whose value is built once on ``world_size`` ranks.

    The body runs through :func:`meshsim.run` the first time a test of ``scope`` asks for the
    fixture; its per-rank return values are the fixture's value, a :class:`PerRank`. The body
    may take ``rank`` and ``world_size``. Process groups do not outlive the run: return plain
    data (paths, tensors, numbers).

    Example:
        ```python
        @distributed_fixture(world_size=4)
        def shards(rank, world_size):
            ...  # write this rank's shard
            return f"/tmp/ckpt/shard-{rank}.pt"

        @pytest.mark.meshsim(world_size=4)
        def test_load(rank, shards):  # each rank gets its own shard's path
            ...
        ```
    """

    def decorate(body: Callable[..., Any]) -> Any:
        wanted = set(inspect.signature(body).parameters) & {"rank", "world_size"}

        @functools.wraps(body)
        def on_rank() -> Any:
            from meshsim.harness import context

            here = context()
            given = {"rank": here.rank, "world_size": here.world_size}
            return body(**{k: given[k] for k in wanted})

        def fixture() -> PerRank:
            from meshsim.harness import run

            return PerRank(run(on_rank, world_size, backend=backend, timeout=timeout))

        fixture.__doc__ = body.__doc__
        return pytest.fixture(scope=scope, name=name or body.__name__)(fixture)

    return decorate
