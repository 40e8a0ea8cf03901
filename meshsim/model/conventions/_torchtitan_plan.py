"""torchtitan's ~230 getter kinds (``_torchtitan_api.api_kinds``), worked out once per pattern.

What each getter call answers (which raise and with what, which return None, and which view
each returns) follows from the version, the backend, the views' dim names, which axes are on,
and which root axes have size 1 (every size, under torch 2.10-2.12's stride rule for slices),
never from the degrees themselves. A world-1,024 sweep asks its 7,010 ``current`` layouts the
same ~230 questions in a few hundred such patterns, so the first layout of a pattern is
answered call by call (the statement of the rules, in ``_torchtitan_api``), and each later one
only re-slices the views those answers name. ``tests/model/test_torchtitan_plan.py`` holds
the two ways to the same kinds.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release
from meshsim.model.conventions import _torchtitan_api as api
from meshsim.model.expected import Kind
from meshsim.model.layout import Layout, known_slice

#: Patterns kept (a world's sweep meets a few hundred), forgotten all at once.
KEPT_PLANS: Final = 2048


@dataclass(frozen=True)
class _Plan:
    """One pattern's answers: each view an answer names, as (global view, dims) to slice, and
    per call its name, its description and either the index of its view or its kind (a
    refusal or a None answer, the same for every layout of the pattern)."""

    views: tuple[tuple[str, tuple[str, ...]], ...]
    calls: tuple[tuple[str, str, int | Kind], ...]


_PLANS: dict[Hashable, _Plan | None] = {}
_UNKNOWN = object()
_LOCK = threading.Lock()


def api_kinds(views: api._Views) -> dict[str, Kind]:
    """``_torchtitan_api.api_kinds(views)``, from the plan of the views' pattern."""
    key = _pattern(views)
    plan = _PLANS.get(key, _UNKNOWN)
    if isinstance(plan, _Plan):
        return _follow(plan, views)
    if plan is None:  # an answer no plan can replay: always call by call
        return api.api_kinds(views)
    answers: dict[str, api.Answer] = {}
    kinds = api.api_kinds(views, answers)
    with _LOCK:
        if len(_PLANS) >= KEPT_PLANS:
            _PLANS.clear()
        _PLANS[key] = _plan(views, kinds, answers)
    return kinds


def _pattern(views: api._Views) -> Hashable:
    """What decides every answer but the ranks (see the module's docstring)."""
    rule = torch_release.slice_order_rule()
    meshes = tuple(
        (
            name,
            mesh.root_names,
            mesh.dim_names,
            tuple(mesh.aliases.items()),
            mesh.root_shape if rule == "strides" else tuple(s == 1 for s in mesh.root_shape),
        )
        for name, mesh in _sources(views).items()
    )
    axes = tuple((axis, views.exists(axis)) for axis in views.single)
    return (views.version, views.backend, rule, meshes, axes)


def _sources(views: api._Views) -> dict[str, Layout]:
    return {"world_mesh": views.world, **views.global_meshes}


def _plan(
    views: api._Views, kinds: dict[str, Kind], answers: dict[str, api.Answer]
) -> _Plan | None:
    """The plan that gives ``kinds`` again; None where an answer is no slice of a global view
    (then this pattern is always answered call by call)."""
    sources = _sources(views)
    spans: dict[tuple[str, tuple[str, ...]], int] = {}
    calls: list[tuple[str, str, int | Kind]] = []
    for name, kind in kinds.items():
        answer = answers[name]
        if not isinstance(answer, Layout):
            calls.append((name, kind.description, kind))
            continue
        span = _span(sources, answer)
        if span is None:
            return None
        calls.append((name, kind.description, spans.setdefault(span, len(spans))))
    return _Plan(tuple(spans), tuple(calls))


def _span(sources: dict[str, Layout], answer: Layout) -> tuple[str, tuple[str, ...]] | None:
    """The (global view, dims) whose slice is ``answer``, aliases included."""
    for name, source in sources.items():
        if source.mesh is not answer.mesh:
            continue
        try:
            again = source[answer.dim_names]
        except LayoutError:
            continue
        if again == answer and again.aliases == answer.aliases:
            return name, answer.dim_names
    return None


def _follow(plan: _Plan, views: api._Views) -> dict[str, Kind]:
    sources = _sources(views)
    # One kind per view the plan names; every call answered with that view is it renamed.
    made = [
        api.answer_kind(views, "", "", known_slice(sources[name], dims))
        for name, dims in plan.views
    ]
    return {
        name: answer if isinstance(answer, Kind) else made[answer].renamed(name, description)
        for name, description, answer in plan.calls
    }
