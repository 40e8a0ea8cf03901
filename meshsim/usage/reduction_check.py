"""Check, in the parent, what each rank's ``GradientTrace`` found against the reference.

Pure: it reads the :class:`~meshsim.usage.trace_records.RankTrace` values ranks returned and
the :class:`meshsim.Expected` groups, never the live groups the program built, so a program
that reduces over a well-formed but wrong group is caught.

Each parameter needs its gradient reduced over the groups its role names
(:mod:`meshsim.usage.param_roles`). The check compares what reaches a rank: after all-reduces
over groups ``A`` then ``B``, rank ``r`` holds the sum over ``B``'s members of what ``A`` gave
each of them. So HSDP's reduce-scatter over ``dp_shard`` then all-reduce over ``dp_replicate``
satisfies a gradient group that is their product, and one all-reduce over ``tp×dp`` satisfies
"``dp`` and ``tp``". A reduction is read as a reduction over its observed group's kind, that
kind's groups standing for what the other ranks did (each rank's own record is checked too).
Observed groups are named by the reference's kinds (:mod:`meshsim.usage.group_names`); a
group no kind has is "a group the layout does not define". A group reduced over twice is a
finding (the gradient is doubled); a reduction over a single rank changes nothing and is
ignored. Reduce ops (sum, average) are not compared.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshsim.errors import NothingCompared, ReductionMismatch, UsageError
from meshsim.harness.outcome import rank_label
from meshsim.model.expected import Expected
from meshsim.usage.group_names import UNDEFINED, GroupNames, strays
from meshsim.usage.param_roles import RolesArg, describe_roles, needed_kinds, param_roles
from meshsim.usage.trace_records import FUNCTIONAL, Collective, ParamTrace, RankTrace


def assert_gradient_reductions(
    traces: Iterable[RankTrace], expected: Expected, *, roles: RolesArg | None = None
) -> None:
    """Raise :class:`~meshsim.errors.ReductionMismatch` unless every gradient was reduced over
    the groups its parameter needs, and no collective ran over a group the layout lacks.

    ``traces``: what each rank's ``GradientTrace.result(model)`` returned (``meshsim.run``'s
    list). ``roles``: parameter name or glob -> ``"dense"``, ``"expert"``,
    ``"sequence_parallel"`` or ``"embedding"``, winning over the parameters' own marks.

    Example:
        ```python
        traces = meshsim.run(step, 4, backend="gloo")
        assert_gradient_reductions(traces, meshsim.expect("megatron", 4,
                                   tensor_model_parallel_size=2))
        # ReductionMismatch: `norm.weight` on ranks 0-3: gradient reduced over dp-cp [0, 2]
        # (all_reduce at train.py:40), needs dp-cp [0, 2] and tp [0, 1] (sequence parallel: ...)
        ```
    """
    problems = check_reductions(traces, expected, roles=roles)
    if problems:
        raise ReductionMismatch(problems)


def check_reductions(
    traces: Iterable[RankTrace], expected: Expected, roles: RolesArg | None = None
) -> list[str]:
    """Every finding, one line each: parameters first (merged over ranks), then strays.

    Raises :class:`~meshsim.errors.NothingCompared` when nothing needed a reduction and
    nothing was found (every gradient group a single rank): that proves nothing.
    """
    by_rank = _validate(traces, expected)
    names = GroupNames(expected)
    ranks_of: dict[tuple[str, tuple[Any, ...]], list[int]] = {}
    texts: dict[tuple[tuple[Any, ...], int], str] = {}  # each rank names its own groups
    needed_any = False
    with_grads = 0
    for trace in by_rank:
        for param in trace.params:
            with_grads += 1
            verdict = _param_verdict(trace.rank, param, expected, names, roles)
            needed_any = needed_any or verdict.needed
            if verdict.key is not None:
                ranks_of.setdefault((param.name, verdict.key), []).append(trace.rank)
                texts[verdict.key, trace.rank] = verdict.text
    # Parameters with the same finding on the same ranks share one line.
    params_of: dict[tuple[Any, ...], list[str]] = {}
    for (name, key), ranks in ranks_of.items():
        params_of.setdefault((key, tuple(ranks)), []).append(name)
    problems = [
        f"{_names_text(params)} on {rank_label(ranks)}: {texts[key, ranks[0]]}"
        for (key, ranks), params in params_of.items()
    ]
    if not with_grads:
        problems.append("no parameter has a gradient on any rank: trace loss.backward() too")
    problems += _stray_lines(by_rank, names)
    if not problems and not needed_any:
        raise NothingCompared(
            "check_reductions compared nothing: every parameter's needed groups are single "
            "ranks in this layout, so no gradient had to be reduced; that is not a pass"
        )
    return problems


def _names_text(params: list[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in params[:3])
    return shown + (f" and {len(params) - 3} more" if len(params) > 3 else "")


# ---------------------------------------------------------------------------- parameters


class _Verdict:
    __slots__ = ("key", "needed", "text")

    def __init__(self, needed: bool, key: tuple[Any, ...] | None = None, text: str = "") -> None:
        self.needed = needed
        self.key = key
        self.text = text


def _param_verdict(
    rank: int, param: ParamTrace, expected: Expected, names: GroupNames, roles: RolesArg | None
) -> _Verdict:
    kinds = needed_kinds(param.name, param.marks, expected, roles)
    needed = [(k, g) for k in kinds if (g := expected.group_of(rank, k)) is not None and len(g) > 1]
    observed = [r for r in param.reductions if len(set(r.group)) > 1]
    own = {frozenset(g) for g in param.replicated_over} - {frozenset(g) for _, g in needed}
    observed = [
        r for r in observed if not (r.op.endswith(FUNCTIONAL) and frozenset(r.group) in own)
    ]
    labels = [names.name(r.group, prefer=kinds) for r in observed]
    seen = [frozenset(r.group) for r in observed]
    twice = len(set(seen)) != len(seen)
    if None not in labels and not twice:
        reach_needed = names.reach(rank, [k for k, _ in needed])
        reach_observed = names.reach(rank, [lab for lab in labels if lab is not None])
        if reach_needed == reach_observed:
            return _Verdict(bool(needed))
    wanted = param_roles(param.name, param.marks, roles)
    got = _observed_text(observed, labels, twice)
    need = (
        "needs " + " and ".join(f"{k} {list(g)}" for k, g in needed)
        if needed
        else "needs no reduction on this rank (its groups here are the rank alone)"
    )
    text = f"{got}, {need} ({describe_roles(wanted)})"
    if param.note:
        text += f"; {param.note}"
    # Rank-independent: the same finding on other ranks (their own groups) merges into one.
    calls = tuple((label, r.op, r.site) for label, r in zip(labels, observed))
    key = (calls, kinds, wanted, twice, param.note)
    return _Verdict(bool(needed), key, text)


def _observed_text(observed: list[Collective], labels: list[str | None], twice: bool) -> str:
    if not observed:
        return "gradient not reduced at all"
    parts = []
    for call, label in zip(observed, labels):
        where = f"{call.op} at {call.site}" if call.site else call.op
        parts.append(f"{label or UNDEFINED} {list(call.group)} ({where})")
    verb = "reduced twice over the same group: " if twice else "reduced over "
    return "gradient " + verb + " and ".join(parts)


# ---------------------------------------------------------------------------- strays


def _stray_lines(by_rank: list[RankTrace], names: GroupNames) -> list[str]:
    merged: dict[tuple[str, str | None], dict[tuple[int, ...], list[int]]] = {}
    for trace in by_rank:
        for call in strays(trace.collectives, names):
            merged.setdefault((call.op, call.site), {}).setdefault(call.group, []).append(
                trace.rank
            )
    lines = []
    for (op, site), groups in merged.items():
        where = f" at {site}" if site else " (call site unknown)"
        spread = "; ".join(f"{list(g)} on {rank_label(r)}" for g, r in groups.items())
        lines.append(f"{op}{where} runs over {UNDEFINED}: {spread}")
    return lines


def _validate(traces: Iterable[RankTrace], expected: Expected) -> list[RankTrace]:
    found = list(traces)
    wrong = [type(t).__name__ for t in found if not isinstance(t, RankTrace)]
    if wrong or not found:
        raise UsageError(
            "check_reductions takes what each rank's GradientTrace(...).result(model) returned "
            f"(meshsim.run's list), got {wrong or 'nothing'}"
        )
    sizes = {t.world_size for t in found}
    if sizes != {expected.world_size}:
        raise UsageError(
            f"the traces come from a world of {sorted(sizes)} ranks, the reference has "
            f"{expected.world_size}"
        )
    return sorted(found, key=lambda t: t.rank)
