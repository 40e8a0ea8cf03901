"""Compare N ranks' trails with the serial twin's and read the likely mistake off the numbers.

Pure numpy. Each rank's tensor is compared with the matching slice of the serial one, in the
order the step produced them (parameters before the step, logged values, gradients; then the
final parameters), so the first finding is the earliest point where the runs part. A
mismatch is then described by what it is in relation to the serial value:

* a scalar multiple: the ratio is usually a ratio of group sizes (averaged over the wrong
  count, summed where averaged, reduced twice);
* the sum or the mean over one kind's groups is the serial value: a reduction over that kind
  is missing (a partial sum on each member, a logged value not reduced over cp);
* anything else: a member missing from a reduction, or different data or weights.

Replicas (ranks holding the same slice of a parameter) that disagree with each other are
reported as drifting apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from meshsim.usage.tensors import Captured, RankTrail

Array = npt.NDArray[np.float64]

#: (rtol, atol) per dtype, norm-wise: ``|a - s| <= rtol * |s| + atol``. Wide enough for a
#: different reduction order over a few steps, narrow enough that a factor of a group size,
#: a missing member or a different batch stands out by orders of magnitude.
TOLERANCES: Mapping[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-6),
    "bfloat16": (3e-2, 1e-3),
    "float16": (5e-3, 1e-4),
}
_DEFAULT_TOLERANCE = TOLERANCES["float32"]

SECTIONS = ("params", "values", "grads")


@dataclass(frozen=True)
class Finding:
    """One mismatch: where (section, step, name), which ranks, and the sentence that says it."""

    section: str
    step: int
    name: str
    ranks: tuple[int, ...]
    line: str


NO_RATIO = "a scale that is no ratio of group sizes (a loss scale or learning rate differs?)"


@dataclass(frozen=True)
class Comparison:
    """What was compared, how closely, and every finding (none: the runs agree)."""

    findings: tuple[Finding, ...]
    compared: int
    steps: int
    worst: float  # largest relative difference among the comparisons that passed

    @property
    def passed(self) -> bool:
        return not self.findings


def tolerance(
    dtype: str, overrides: Mapping[str, tuple[float, float]] | None = None
) -> tuple[float, float]:
    table = {**TOLERANCES, **(overrides or {})}
    return table.get(dtype.removeprefix("torch."), _DEFAULT_TOLERANCE)


def _norm(array: Array) -> float:
    return float(np.linalg.norm(array.ravel()))


def _wide(array: Array) -> Array:
    """``array`` in float64: records keep float32 tensors as float32 (see ``Captured``), and
    differences, norms and dot products of a million values need float64's accumulation."""
    return np.asarray(array, dtype=np.float64)


def _close(a: Array, s: Array, tol: tuple[float, float]) -> bool:
    rtol, atol = tol
    a, s = _wide(a), _wide(s)
    return a.shape == s.shape and _norm(a - s) <= rtol * _norm(s) + atol


def _relative(a: Array, s: Array) -> float:
    a, s = _wide(a), _wide(s)
    scale = _norm(s)
    diff = _norm(a - s)
    return diff / scale if scale else diff


def _ratio(a: Array, s: Array, tol: tuple[float, float]) -> float | None:
    """``r`` with ``a == r * s`` within tolerance (None: no such scalar)."""
    a, s = _wide(a), _wide(s)
    ss = float(np.dot(s.ravel(), s.ravel()))
    if ss == 0.0:
        return None
    r = float(np.dot(a.ravel(), s.ravel())) / ss
    return r if _close(a, r * s, tol) else None


def _rounding(r: float | None) -> bool:
    """A shared ratio this close to 1 is the precision of the computation, not a scale."""
    return r is not None and abs(r - 1.0) < 1e-4


def _ratio_text(r: float) -> str:
    if r == 0:
        return "0"
    if abs(r) >= 1:
        return f"{r:.4g}x"
    inverse = 1 / r
    if abs(inverse - round(inverse)) < 1e-6:
        return f"{r:.4g}x (1/{round(inverse)})"
    return f"{r:.4g}x"


def format_ranks(ranks: Iterable[int]) -> str:
    from meshsim.checks.diff import format_ranks as fmt

    return fmt(sorted(ranks))


class Kinds:
    """The layout's kinds as ``{name: groups}`` (size > 1, one family per distinct grouping),
    used to explain a mismatch by a reduction over one of them."""

    def __init__(
        self,
        families: Mapping[str, Sequence[tuple[int, ...]]],
        roles: Mapping[str, str] | None = None,
    ) -> None:
        seen: set[tuple[tuple[int, ...], ...]] = set()
        self.families: dict[str, list[tuple[int, ...]]] = {}
        for name, groups in families.items():
            key = tuple(sorted(tuple(g) for g in groups))
            if not groups or len(groups[0]) < 2 or key in seen:
                continue
            seen.add(key)
            self.families[name] = [tuple(g) for g in groups]
        #: role -> kind, for the roles whose kind is among ``families``
        self.roles = {r: k for r, k in (roles or {}).items() if k in self.families}

    def size(self, name: str) -> int:
        return len(self.families[name][0])

    def sized(self, n: int) -> list[str]:
        return [name for name in self.families if self.size(name) == n]

    def label(self, name: str) -> str:
        """``loss (4 ranks, the gradient_reduce group)``: the kind, its size, the role it serves."""
        role = next((r for r, k in self.roles.items() if k == name), None)
        return f"{name} ({self.size(name)} ranks" + (f", the {role} group)" if role else ")")

    def name_of(self, group: tuple[int, ...]) -> str:
        """The kind one of whose groups is ``group`` (as a set), else the ranks themselves."""
        members = set(group)
        for name, groups in self.families.items():
            if any(set(g) == members for g in groups):
                return self.label(name)
        return f"{list(group)} (a group the layout does not define)"


def _reduced_text(captured: Captured, kinds: Kinds) -> str:
    """What the trace saw reduce this gradient, as a clause ending in ``; `` (or nothing)."""
    if captured.reduced is None:
        return ""
    groups = [g for g in captured.reduced if len(g) > 1]
    if not groups:
        return "no collective reduced it on this rank; "
    names = list(dict.fromkeys(kinds.name_of(g) for g in groups))
    return f"reduced over {' then '.join(names)}; "


def _integer(x: float) -> int | None:
    n = round(x)
    return n if n >= 2 and abs(x - n) < 1e-6 * n else None


def _explain_ratio(r: float, kinds: Kinds) -> str:
    up = _integer(r)
    down = _integer(1 / r) if r else None
    grad, data = kinds.roles.get("gradient_reduce"), kinds.roles.get("data_parallel")
    if up is not None and grad and data and kinds.size(grad) == up * kinds.size(data):
        return (
            f"{up} = {grad} ({kinds.size(grad)} ranks) / {data} ({kinds.size(data)}): a loss "
            f"or gradient averaged over {data} where the gradient group {grad} was needed "
            "(context parallelism folds cp into the gradient's mean)"
        )
    if up is not None:
        named = kinds.sized(up)
        if named:
            return (
                f"{up} is the size of {' / '.join(named)}: a sum where a mean over one of "
                f"them was needed, a reduction done twice, or a count {up}x too small"
            )
        return f"divided by a count {up}x too small, or reduced more than once"
    if down is not None:
        named = kinds.sized(down)
        if named:
            return (
                f"{down} is the size of {' / '.join(named)}: averaged over one of them once "
                f"too often, or divided by a count {down}x too large (a global count where "
                "the local one was needed?)"
            )
        return f"divided by a count {down}x too large"
    return NO_RATIO


def _over_kind(
    holders: Mapping[int, Captured], full: Array, kinds: Kinds, tol: tuple[float, float]
) -> str | None:
    """A kind whose groups' sum (or mean) of the members' values is the serial value."""
    # The smallest group that explains it: a value missing its cp reduction is also "not
    # averaged" over every larger group that contains cp.
    by_size = sorted(kinds.families.items(), key=lambda item: len(item[1][0]))
    for name, groups in by_size:
        for how in ("sum", "mean"):
            matched = 0
            for group in groups:
                members = [holders.get(r) for r in group]
                if any(m is None for m in members):
                    break
                shards = {m.shard for m in members if m is not None}
                if len(shards) != 1:
                    break
                first = members[0]
                assert first is not None
                stacked = np.stack([_wide(m.array) for m in members if m is not None])
                combined = stacked.sum(axis=0) if how == "sum" else stacked.mean(axis=0)
                if not _close(combined, first.expected_part(full), tol):
                    break
                matched += 1
            if matched == len(groups) and matched:
                verb = "summed" if how == "sum" else "averaged"
                return (
                    f"the {how} over {kinds.label(name)} is the serial value: not {verb} "
                    f"over {name}"
                )
    return None


_ROLE_HINTS = {
    "sequence_parallel": (
        "under sequence parallelism a weight replicated over tp (norms, biases) gets a partial "
        "gradient on each tp rank and needs the tp all-reduce"
    ),
    "expert": (
        "expert parameters are reduced over the expert data-parallel group, not the dense "
        "data-parallel one"
    ),
    "embedding": "tied embeddings are reduced over the embedding group (first and last stage)",
}


def _subject(section: str, name: str, step: int, steps: int) -> str:
    if section == "values":
        return f"logged `{name}` at step {step}"
    if section == "grads":
        return f"grad of `{name}` at step {step}"
    if step > steps:
        return f"`{name}` after {steps} optimizer step{'s' if steps != 1 else ''}"
    if step == 1:
        return f"`{name}` before the first step"
    return f"`{name}` before step {step}"


def _describe(
    section: str,
    step: int,
    steps: int,
    name: str,
    holders: Mapping[int, Captured],
    wrong: Sequence[int],
    full: Array,
    kinds: Kinds,
    tols: tuple[float, float],
) -> str:
    subject = _subject(section, name, step, steps)
    sample = holders[wrong[0]]
    ratios = {r: _ratio(holders[r].array, holders[r].expected_part(full), tols) for r in wrong}
    shared = {None if v is None else round(v, 9) for v in ratios.values()}
    ranks = f"on {format_ranks(wrong)}"
    if len(shared) == 1 and None not in shared and _rounding(next(iter(ratios.values()))):
        worst = max(_relative(holders[r].array, holders[r].expected_part(full)) for r in wrong)
        relation = (
            f"differs from the serial one by {worst:.2g} (relative), above the tolerance "
            f"{tols[0]:g} for {sample.dtype}"
        )
        why = (
            "rounding, not a wrong group: a value computed in a lower precision than it is "
            "compared in (a float32 loss logged as a Python float is held to float64's "
            "tolerance: record the tensor, or pass tolerances=)"
        )
        role_hint = False
    elif len(shared) == 1 and None not in shared:
        r = next(iter(ratios.values()))
        assert r is not None
        relation = f"is {_ratio_text(r)} the serial one"
        why = _explain_ratio(r, kinds)
        role_hint = False
    else:
        why = _over_kind(holders, full, kinds, tols)
        role_hint = why is None or "over " + str(kinds.roles.get("tensor")) in why
        if None not in shared:
            by_ratio: dict[float, list[int]] = {}
            for rank, ratio in ratios.items():
                by_ratio.setdefault(round(float(ratio or 0), 6), []).append(rank)
            shown = ", ".join(
                f"{r:.4g}x on {format_ranks(rs)}" for r, rs in sorted(by_ratio.items())
            )
            relation = f"is a multiple of the serial one that differs between ranks ({shown})"
            why = why or (
                "scaled per rank: a clipping norm, loss scale or token count computed over "
                "too small a group (each rank's own shard instead of the whole tensor?)"
            )
            role_hint = False
        else:
            worst = max(_relative(holders[r].array, holders[r].expected_part(full)) for r in wrong)
            relation = f"differs from the serial one by {worst:.3g} (relative; no multiple of it)"
        if why is None and section == "params" and step == 1:
            why = (
                "the initial weights differ: build them from one seed on every rank "
                "(tensor-parallel peers seeded differently?)"
            )
        if why is None:
            why = (
                "a member missing from a reduction (a partial sum), a different batch, or "
                "different weights"
            )
    hint = _ROLE_HINTS.get(sample.role or "") if role_hint and section == "grads" else None
    traced = _reduced_text(sample, kinds) if section == "grads" else ""
    line = f"{subject} {ranks} {relation}: {traced}{why}"
    return line + (f"; {hint}" if hint else "")


def _drift(
    section: str, step: int, steps: int, name: str, holders: Mapping[int, Captured], tol: tuple
) -> str | None:
    """Replicas (same slice) that disagree with each other."""
    by_slice: dict[object, list[int]] = {}
    for rank, captured in holders.items():
        by_slice.setdefault(captured.shard, []).append(rank)
    for ranks in by_slice.values():
        first = holders[ranks[0]].array
        apart = [r for r in ranks[1:] if not _close(holders[r].array, first, tol)]
        if apart:
            agree = [r for r in ranks if r not in apart]
            other = holders[apart[0]].array
            alike = all(_close(holders[r].array, other, tol) for r in apart[1:])
            return (
                f"{_subject(section, name, step, steps)} differs between replicas: "
                f"{format_ranks(agree)} {'holds' if len(agree) == 1 else 'hold'} one value, "
                f"{format_ranks(apart)} {'another' if alike else 'others, not all the same'} "
                "(replicas drift apart: a gradient reduced over too small a group, or a "
                "different update on some ranks)"
            )
    return None


def _points(trail: RankTrail) -> list[tuple[str, int, dict[str, Captured]]]:
    points: list[tuple[str, int, dict[str, Captured]]] = []
    for step, snap in enumerate(trail.snapshots, start=1):
        # Gradients before logged values: a logged norm or loss derives from them.
        points += [("params", step, snap.params), ("grads", step, snap.grads)]
        points.append(("values", step, snap.values))
    points.append(("params", len(trail.snapshots) + 1, trail.final))
    return points


def compare(
    trails: Sequence[RankTrail],
    serial: RankTrail,
    kinds: Kinds,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
) -> Comparison:
    """Every rank's trail against the serial one; findings in the order the step ran."""
    steps = len(serial.snapshots)
    findings: list[Finding] = []
    counts = {t.rank: len(t.snapshots) for t in trails}
    off = sorted(r for r, n in counts.items() if n != steps)
    if off:
        shown = ", ".join(f"rank {r}: {counts[r]}" for r in off[:4])
        line = (
            f"the ranks recorded a different number of steps than the serial step ({steps}): "
            f"{shown}; call ctx.record once per step on every rank"
        )
        return Comparison((Finding("steps", 0, "", tuple(off), line),), 0, steps, 0.0)
    serial_points = _points(serial)
    rank_points = {t.rank: _points(t) for t in trails}
    compared, worst = 0, 0.0
    for index, (section, step, reference) in enumerate(serial_points):
        named: dict[str, dict[int, Captured]] = {}
        for rank, points in rank_points.items():
            for name, captured in points[index][2].items():
                named.setdefault(name, {})[rank] = captured
        for name in sorted(set(named) - set(reference)):
            holders = sorted(named[name])
            line = (
                f"`{name}` ({section}) on {format_ranks(holders)} has no counterpart in "
                f"the serial step, whose names are {sorted(reference)[:6]}: record the same names "
                "on both (strip wrapper prefixes, name experts by their global index)"
            )
            findings.append(Finding(section, step, name, tuple(holders), line))
        for name, full_captured in reference.items():
            holders = named.get(name, {})
            if not holders:
                if section != "values":
                    line = f"`{name}` ({section}) is in the serial step but no rank recorded it"
                    if section == "grads":
                        line += (
                            ": no rank's parameter had a gradient (not reached by the loss, "
                            "or not the tensor the model trains with)"
                        )
                    findings.append(Finding(section, step, name, (), line))
                continue
            full = full_captured.array
            tol = tolerance(full_captured.dtype, tolerances)
            wrong: list[int] = []
            for rank, captured in sorted(holders.items()):
                compared += 1
                try:
                    part = captured.expected_part(full)
                except ValueError as error:
                    line = f"`{name}` ({section}) on rank {rank}: {error}"
                    findings.append(Finding(section, step, name, (rank,), line))
                    continue
                if part.shape != captured.array.shape:
                    line = (
                        f"`{name}` ({section}) on rank {rank} has shape "
                        f"{captured.array.shape}, the serial one {part.shape}"
                        + ("" if captured.shard is None else f" (as {captured.shard})")
                    )
                    findings.append(Finding(section, step, name, (rank,), line))
                    continue
                if _close(captured.array, part, tol):
                    worst = max(worst, _relative(captured.array, part))
                else:
                    wrong.append(rank)
            if wrong:
                line = _describe(section, step, steps, name, holders, wrong, full, kinds, tol)
                findings.append(Finding(section, step, name, tuple(wrong), line))
            drift = _drift(section, step, steps, name, holders, tol)
            if drift is not None and section != "values":
                findings.append(Finding(section, step, name, tuple(sorted(holders)), drift))
    findings = _point_to_logged_ratios(findings)
    return Comparison(tuple(findings), compared, steps, worst if math.isfinite(worst) else 0.0)


#: What a gradient finding says when nothing in the numbers named a cause.
_WEAK = (
    NO_RATIO,
    "a member missing from a reduction (a partial sum), a different batch, or different weights",
)


def _point_to_logged_ratios(findings: list[Finding]) -> list[Finding]:
    """A gradient whose numbers name no cause, at a step where a logged value names one, says
    so. Gradient clipping hides the cause in the gradients: it rescales a gradient a wrong
    loss scale made 2x to some other factor, and a norm computed from each rank's own shards
    rescales each rank differently; the logged loss or norm still shows it."""
    pointers: dict[int, str] = {}
    # Replicas whose gradients already differ explain a norm that differs between ranks (a
    # reduction missed a dim): no clipping needs to be blamed there.
    drifted = {f.step for f in findings if f.section == "grads" and "between replicas" in f.line}
    for f in findings:
        if f.section != "values" or f.step in pointers:
            continue
        what = f.line.split(" on ", 1)[0].removeprefix("logged ")  # "`loss` at step 1"
        if "that differs between ranks" in f.line and f.step not in drifted:
            pointers[f.step] = (
                f"the logged {what} differs between ranks: a clipping norm from each rank's "
                "own shards rescales each rank's gradients differently"
            )
        elif " the serial one: " in f.line and NO_RATIO not in f.line:
            ratio = f.line.split(" is ", 1)[1].split(" the serial one", 1)[0]  # "2x"
            pointers[f.step] = (
                f"but the logged {what} is {ratio} the serial one, a clean ratio: gradient "
                "clipping rescales a gradient that a wrong loss scale or token count scaled"
            )
    pointed = []
    for f in findings:
        weak = next((w for w in _WEAK if f.line.endswith(w)), None)
        if f.section == "grads" and weak is not None and f.step in pointers:
            f = replace(f, line=f"{f.line}; {pointers[f.step]}")
        pointed.append(f)
    return pointed
