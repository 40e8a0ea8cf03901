"""verify: build a framework's groups live on N ranks and diff them with the reference model.

``verify("megatron", 8, "gloo", tensor_model_parallel_size=2)`` computes the reference
(:func:`meshsim.expect`), runs the framework's builder (``meshsim.builders``) on every rank
through ``meshsim.harness.run``, brings each rank's :class:`~meshsim.checks.Observation` back to
this process and diffs them. A config both sides reject the same way passes (the check is then
"the framework refuses what the reference refuses"). Importing this module does not import
torch: ranks import it when they build.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshsim import torch_private
from meshsim.builders import BUILDERS
from meshsim.builders import real as real_adapters
from meshsim.checks import MeshDiff, Observation, ObservedLayout, diff
from meshsim.errors import LayoutError, RankFailure, RankTimeout, UsageError
from meshsim.model.conventions import expect
from meshsim.model.expected import Expected
from meshsim.model.sweep import LayoutCase

#: meshsim's own errors that stand for a refusal, with the framework's exception in ``upstream``
#: (``TorchTooOld``: a torch release without the method the framework calls).
_REFUSALS = frozenset({"FrameworkRejection", "TorchTooOld"})
#: Exception types torch's DeviceMesh raises for a layout it refuses; a builder stopping with
#: one of these mirrors a framework error (anything else, e.g. TypeError, is a builder bug).
_MIRRORED = frozenset(
    {"RuntimeError", "ValueError", "KeyError", "AssertionError", "IndexError"}
    | {"NotImplementedError"}  # torch 2.10-2.12 slicing a non-contiguous flattened dim
)
#: Cases built in one fake-tier run by :func:`verify_many` (fake ranks run one after another).
FAKE_BATCH = 32


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one live check: passed when no diff and no error.

    ``rejected`` holds the reference's error when both the reference and the builder reject the
    config (a pass). ``kinds_checked`` lists the kinds compared, in observation order;
    ``seconds`` is the wall time of the build (slowest rank) plus the diff.
    """

    framework: str
    world_size: int
    config: Mapping[str, Any]
    backend: str
    real: bool
    diff: MeshDiff | None
    kinds_checked: tuple[str, ...]
    seconds: float
    error: str | None
    rejected: str | None = field(default=None)
    #: Every rank's observation (None when no rank built its groups): what ``--cross-check``
    #: compares between tiers, group by group.
    observations: tuple[Observation, ...] | None = field(default=None, repr=False, compare=False)
    #: Kinds of the reference that were not compared, each with why (the builder or the
    #: framework's code does not hand that group out); empty when every kind was checked.
    skipped: Mapping[str, str] = field(default_factory=dict)
    #: What the ranks printed while this case was built, where the caller captured it
    #: (``meshsim sweep`` does, and shows it only for a failing layout); "" otherwise.
    output: str = field(default="", repr=False, compare=False)
    #: The ranks that built the groups on the fake tier when not every rank did (``ranks=``);
    #: None when every rank built them.
    ranks: tuple[int, ...] | None = None

    @property
    def tier_limits(self) -> tuple[str, ...]:
        """What this tier cannot ask of any kind: the fake backend neither communicates (no
        group is proven by an all-gather) nor has other backends (every group is fake)."""
        if self.backend != "fake":
            return ()
        return (
            "groups are not proven by an all-gather (the fake backend does not communicate)",
            "backends are not compared (every group of a fake world is fake)",
        )

    @property
    def passed(self) -> bool:
        return self.error is None and self.diff is None

    def __str__(self) -> str:
        head = f"{self.framework} world_size={self.world_size} on {self.backend}: "
        if self.passed and self.rejected:
            return head + f"PASS, rejected by both ({self.rejected})"
        if self.passed:
            return head + f"PASS, {len(self.kinds_checked)} kinds match"
        return head + "FAIL\n" + (self.error or str(self.diff))


@dataclass(frozen=True)
class BuildFailure:
    """What a builder raised on one rank, as plain data (crosses process boundaries)."""

    rank: int
    error_type: str
    message: str
    upstream: str | None
    #: The torch.distributed call the error came out of (``new_group for group (0,1)``), when
    #: the harness recorded it: a framework's refusal then names its group call.
    call: str | None = None

    @property
    def mirrored(self) -> bool:
        """True when the error stands for a framework/torch refusal rather than a builder bug."""
        return self.error_type in _REFUSALS or self.error_type in _MIRRORED

    @property
    def raised(self) -> str | None:
        """The exception type the framework would raise, as the builder claims it."""
        if self.error_type in _REFUSALS:
            return self.upstream
        return self.error_type


Built = tuple["Observation | BuildFailure", float]


def build_on_rank(
    framework: str, world_size: int, config: Mapping[str, Any], real: bool = False
) -> Built:
    """Run on a rank: the builder's Observation (or its failure) and the seconds it took."""
    import torch.distributed as dist

    # Cases of a batch run one after another on a rank: torch < 2.10 would hand this case the
    # previous one's flattened meshes (its registries match meshes by value), so forget them.
    torch_private.reset_mesh_resources()
    start = time.perf_counter()
    module = real_adapters.REAL_BUILDERS[framework] if real else BUILDERS[framework]
    try:
        built: Observation | BuildFailure = importlib.import_module(module).build(
            world_size, dict(config)
        )
    except Exception as error:  # reported, compared with the reference's verdict
        built = build_failure(int(dist.get_rank()), error)
    return built, time.perf_counter() - start


def build_failure(rank: int, error: BaseException) -> BuildFailure:
    """``error`` as a :class:`BuildFailure`, naming the group call it came out of when the
    harness recorded one (call inside the rank, in the ``except`` that caught it)."""
    from meshsim.harness import recorder

    sink = recorder._current_sink()
    call = sink.call_behind(error) if sink is not None else None
    return BuildFailure(
        rank,
        type(error).__name__,
        str(error),
        getattr(error, "upstream", None),
        call.describe() if call is not None else None,
    )


def failure_text(failures: Sequence[BuildFailure]) -> str:
    """``TypeError in new_group for group () on ranks 0-3: torch could not construct ...``:
    the first failure, the group call it came out of and every rank that raised the same."""
    from meshsim.checks.diff import format_ranks

    first = failures[0]
    same = sorted(
        {f.rank for f in failures if (f.error_type, f.call) == (first.error_type, first.call)}
    )
    where = f" in {first.call}" if first.call else ""
    return f"{first.error_type}{where} on {format_ranks(same)}: {_short(first.message)}"


def _short(message: str) -> str:
    """One line of an error message. torch's pybind refusal to construct a ProcessGroup
    (several lines listing constructor overloads) becomes what it was invoked with."""
    import re

    if "incompatible constructor arguments" in message:
        invoked = re.search(r"Invoked with: (.*)", message)
        args = (
            re.sub(r"<[^>]*Store object at 0x[0-9a-f]+>", "store", invoked.group(1))
            if invoked
            else "?"
        )
        return f"torch could not construct the ProcessGroup (invoked with {args.strip()})"
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    return lines[0].strip() + (" ..." if len(lines) > 1 else "")


def _build_batch(cases: Sequence[tuple[str, int, Mapping[str, Any], bool]]) -> list[Built]:
    return [build_on_rank(*case) for case in cases]


def verify(
    framework: str,
    world_size: int,
    backend: str = "gloo",
    *,
    real: bool = False,
    timeout: float = 120.0,
    ranks: Sequence[int] | None = None,
    **config: Any,
) -> VerifyResult:
    """Build ``framework``'s groups for ``config`` on ``world_size`` ranks and diff them.

    ``real=True`` runs the real framework's own code (an adapter in ``meshsim.builders.real``)
    instead of meshsim's torch builder. ``ranks=`` samples ranks on the fake tier (huge worlds).
    Harness failures (a rank crashed, timed out) come back as ``error``, never raised.
    """
    _check(framework, real)
    reference = _reference(framework, world_size, config)
    args = (framework, world_size, config, real)
    start = time.perf_counter()
    try:
        built = _run(build_on_rank, world_size, backend, timeout, ranks, args)
    except (RankFailure, RankTimeout) as error:
        result = _result(args, backend, seconds=time.perf_counter() - start, error=str(error))
    else:
        result = _judge(args, backend, reference, built)
    return _built_on(result, ranks)


def verify_case(case: LayoutCase, backend: str = "gloo", **options: Any) -> VerifyResult:
    """:func:`verify` of one :class:`~meshsim.LayoutCase` (a sweep's parameter)."""
    return verify(case.framework, case.world_size, backend, **options, **case.config)


def verify_many(
    cases: Iterable[LayoutCase],
    backend: str = "gloo",
    *,
    real: bool = False,
    timeout: float = 120.0,
    ranks: Sequence[int] | None = None,
) -> Iterator[VerifyResult]:
    """:func:`verify` every case, in order, as results arrive.

    On the fake tier consecutive cases of one world size share a harness run (each rank builds
    up to ``FAKE_BATCH`` cases in turn), since starting a run costs more than building. Other
    tiers run one case per harness run, so a case that hangs or crashes stays its own failure
    (the gloo tier's worker pool stays warm between runs). ``ranks``: on the fake tier, only
    these ranks build each case.
    """
    if ranks is not None and backend != "fake":
        raise UsageError(f"ranks= samples ranks on the fake tier only, not on {backend!r}")
    pending: list[LayoutCase] = []
    for case in cases:
        _check(case.framework, real)
        if backend != "fake":
            yield verify_case(case, backend, real=real, timeout=timeout)
            continue
        if pending and (pending[0].world_size != case.world_size or len(pending) >= FAKE_BATCH):
            yield from _fake_batch(pending, real, timeout, ranks)
            pending = []
        pending.append(case)
    if pending:
        yield from _fake_batch(pending, real, timeout, ranks)


def _fake_batch(
    cases: list[LayoutCase], real: bool, timeout: float, ranks: Sequence[int] | None
) -> Iterator[VerifyResult]:
    world = cases[0].world_size
    batch = [(c.framework, world, c.config, real) for c in cases]
    references = [_reference(c.framework, world, c.config) for c in cases]
    try:
        per_rank = _run(_build_batch, world, "fake", timeout * len(cases), ranks, (batch,))
    except (RankFailure, RankTimeout):
        # Something broke the shared run: redo each case alone so the failure names its case.
        for case in cases:
            yield verify_case(case, "fake", real=real, timeout=timeout, ranks=ranks)
        return
    for index, (args, reference) in enumerate(zip(batch, references)):
        result = _judge(args, "fake", reference, [built[index] for built in per_rank])
        yield _built_on(result, ranks)


def _check(framework: str, real: bool) -> None:
    if framework not in BUILDERS:
        raise UsageError(
            f"unknown framework {framework!r}; known frameworks: {', '.join(BUILDERS)}"
        )
    if real:
        real_adapters.require(framework)


def _reference(
    framework: str, world_size: int, config: Mapping[str, Any]
) -> Expected | LayoutError:
    try:
        return expect(framework, world_size, **config)
    except LayoutError as error:
        return error


def _run(fn: Any, world: int, backend: str, timeout: float, ranks: Any, args: tuple) -> list[Any]:
    from meshsim.harness import run

    return list(run(fn, world, backend=backend, timeout=timeout, ranks=ranks, args=args))


Args = tuple[str, int, Mapping[str, Any], bool]


def _built_on(result: VerifyResult, ranks: Sequence[int] | None) -> VerifyResult:
    """``result``, saying which ranks built it when not every rank did."""
    return result if ranks is None else dataclasses.replace(result, ranks=tuple(ranks))


def _result(args: Args, backend: str, **fields: Any) -> VerifyResult:
    framework, world, config, real = args
    values = {"diff": None, "kinds_checked": (), "seconds": 0.0, "error": None, **fields}
    return VerifyResult(framework, world, dict(config), backend, real, **values)


def _judge(
    args: Args, backend: str, reference: Expected | LayoutError, built: list[Built]
) -> VerifyResult:
    """Compare what every rank built with the reference's verdict."""
    start = time.perf_counter()
    build_seconds = max((seconds for _, seconds in built), default=0.0)
    observations = [b for b, _ in built if isinstance(b, Observation)]
    failures = [b for b, _ in built if isinstance(b, BuildFailure)]

    def done(**fields: Any) -> VerifyResult:
        seconds = build_seconds + time.perf_counter() - start
        return _result(args, backend, seconds=seconds, **fields)

    if failures and observations and isinstance(reference, LayoutError):
        # Some frameworks fail only on the ranks a bad config leaves out (OLMo's HSDP split that
        # covers part of the world builds on the ranks inside it): a rejection all the same, as
        # long as every failing rank raised what the reference says the framework raises.
        verdicts = [_judge_failure(f, reference) for f in failures]
        if all("rejected" in v for v in verdicts):
            who = sorted(f.rank for f in failures)
            return done(rejected=f"{verdicts[0]['rejected']} (on ranks {who}; the others built)")
    if failures and observations:
        return done(
            error=f"ranks disagree: {failure_text(failures)}; the others built their groups"
        )
    if failures:
        return done(**_judge_failure(failures, reference))
    if isinstance(reference, LayoutError):
        return done(
            error=f"the reference rejects this config ({_upstream(reference)}: "
            f"{reference}), but the builder built it"
        )
    observed = ObservedLayout.of(observations)
    # Derived kinds (a role's product of dims no process group spans) are nothing to observe.
    derived = reference.derived_kinds()
    names = [*reference.kinds(), *reference.unavailable()]
    known = dict.fromkeys(n for n in names if n not in derived)  # ordered, O(1) in
    checked = tuple(name for name in observed.names() if name in known)
    if not checked:
        return done(error=f"the builder observed no kind the reference knows: {observed.names()}")
    builder = f"the real {args[0]} adapter" if args[3] else f"meshsim's {args[0]} builder"
    return done(
        diff=diff(observed, reference, checked),
        kinds_checked=checked,
        observations=tuple(observed),
        skipped={
            kind: f"{builder} does not observe it (no rank recorded a group or its absence)"
            for kind in known
            if kind not in checked
        },
    )


def _judge_failure(
    failures: Sequence[BuildFailure], reference: Expected | LayoutError
) -> dict[str, Any]:
    failure = failures[0]
    said = failure_text(failures)
    if failure.error_type in ("ModuleNotFoundError", "ImportError"):
        return {"error": f"the builder could not import what it needs ({said})"}
    if not isinstance(reference, LayoutError):
        return {"error": f"the builder raised {said}, but the reference accepts this config"}
    if not failure.mirrored and failure.error_type != reference.upstream:
        return {
            "error": f"the builder crashed with {said} (a builder bug) on a config the "
            f"reference rejects: {reference}"
        }
    ours, theirs = failure.raised, reference.upstream
    if ours and theirs and ours != theirs:
        return {
            "error": f"both reject the config, but the reference says the framework raises "
            f"{theirs} ({reference}) while the builder raised {ours} ({said})"
        }
    return {"rejected": f"{_upstream(reference)}: {reference}"}


def _upstream(error: LayoutError) -> str:
    return error.upstream or "LayoutError"
