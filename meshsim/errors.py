"""Every exception meshsim raises, each subclassing the builtin it means."""

from __future__ import annotations

from typing import Any


class MeshsimError(Exception):
    """Base class of all meshsim errors."""


class LayoutError(MeshsimError, ValueError):
    """An invalid layout or config: degrees, axis names, slicing or flattening rules.

    ``upstream`` names the exception type the real framework raises for the same mistake
    (``"KeyError"``, ``"RuntimeError"``, ``"AssertionError"``, ...), so live checks can
    compare meshsim's verdict with the framework's.
    """

    def __init__(self, message: str, *, upstream: str | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream


class UsageError(MeshsimError, ValueError):
    """Bad arguments to a meshsim API (world size, backend name, timeout, ...)."""


class LayoutMismatch(MeshsimError, AssertionError):
    """Live groups differ from the reference; ``diff`` holds every mismatch, compactly."""

    def __init__(self, diff: object) -> None:
        super().__init__(str(diff))
        self.diff = diff


class GroupsCrossNodes(MeshsimError, AssertionError):
    """Groups that must stay inside a node span several (``meshsim.assert_within_nodes``)."""


# --- harness errors (meshsim.harness.run) -------------------------------------------------


class MeshesDisagree(MeshsimError, AssertionError):
    """Meshes of one job disagree where they overlap (``meshsim.assert_meshes_agree``).

    ``disagreements`` lists each finding: the rank, both meshes and what differs.
    """

    def __init__(self, message: str, disagreements: list[Any]) -> None:
        super().__init__(message)
        self.disagreements = disagreements


class RankFailure(MeshsimError, AssertionError):
    """One or more ranks of a ``meshsim.run`` body failed (raised, exited or died).

    An ``AssertionError`` so that a failing rank reads as a failing test under pytest, the
    same as a failing single-process ``assert``. ``outcomes`` holds every rank's
    ``RankOutcome`` (structured: error type, message, traceback, exit code, signal name);
    ``failures`` holds only the ranks that did not return normally.
    """

    def __init__(self, message: str, outcomes: tuple = (), **info: object) -> None:
        super().__init__(message)
        self.outcomes = tuple(outcomes)
        self.info = dict(info)

    @property
    def failures(self) -> tuple:
        """The outcomes of the ranks that did not return a value."""
        return tuple(o for o in self.outcomes if not getattr(o, "ok", False))


class CollectiveDivergence(RankFailure):
    """Ranks that must issue the same collectives (or group creations) issued different ones.

    Found by the fake tier, which records every rank's calls and compares ranks that have to
    agree: members of a group must issue the same collectives on it in the same order, and
    world-synchronised group creations must match on every rank. On real backends this
    mismatch is the classic hang at step 1. A ``RankFailure`` because it is a bug in the
    ranks' program. ``index`` is the 0-based position of the first mismatch in the compared
    sequence, ``ranks`` the two ranks compared and ``calls`` what each did there.
    """

    def __init__(
        self,
        message: str,
        outcomes: tuple = (),
        *,
        kind: str = "collective",
        group: tuple[int, ...] | None = None,
        index: int = 0,
        ranks: tuple[int, int] = (0, 0),
        calls: tuple[str, str] = ("", ""),
        steps: tuple[int | None, int | None] = (None, None),
    ) -> None:
        super().__init__(message, outcomes)
        self.kind = kind
        self.group = group
        self.index = index
        self.ranks = ranks
        self.calls = calls
        self.steps = steps
        #: How the run ended because of the divergence (the ranks that hung, crashed or were
        #: stopped), when it did not end normally; ``None`` otherwise.
        self.consequence: str | None = None


class RankTimeout(MeshsimError, TimeoutError):
    """A ``meshsim.run`` body did not finish within its timeout; every rank was stopped.

    ``stacks`` maps rank -> that rank's Python stack when the deadline hit, ``collectives``
    maps rank -> the collective it was blocked in (``None`` if none), ``survivors`` lists
    threaded-tier ranks whose threads could not be stopped (they stay parked as daemon
    threads; see ``meshsim.harness.threaded``). ``finding`` is who waits for whom, the
    message's first line up to the run's summary (``ranks 0, 2 wait in all_gather on the
    world at test_x.py:12 for rank 1; rank 1 is outside any collective at test_x.py:9
    (time.sleep(1))``), the same on every tier; ``waits`` maps each waiting rank -> the
    ranks it waits for (both ``None`` when the recordings were not available).
    """

    def __init__(
        self,
        message: str,
        outcomes: tuple = (),
        *,
        stacks: dict[int, str] | None = None,
        collectives: dict[int, str | None] | None = None,
        survivors: tuple[int, ...] = (),
        finding: str | None = None,
        waits: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__(message)
        self.outcomes = tuple(outcomes)
        self.stacks = dict(stacks or {})
        self.collectives = dict(collectives or {})
        self.survivors = tuple(survivors)
        self.finding = finding
        self.waits = waits


class RunStopped(MeshsimError):
    """A run stopped on request from outside it (``meshsim.harness.stopping``: the CLI's Ctrl-C
    or SIGTERM during a live check); its ranks were stopped as at a timeout. Not a verdict on
    the program, so nothing that judges a run catches it."""


class NotEnoughGPUs(MeshsimError, RuntimeError):
    """The nccl tier needs one GPU per rank and this machine has fewer."""


class TeardownWarning(MeshsimError, RuntimeWarning):
    """A rank died during teardown after its result had already arrived.

    The body itself succeeded on that rank, so ``meshsim.run`` still returns its values;
    the death is reported (this warning plus ``RunResult.teardown_failures``) instead of
    being hidden or blamed on the body.
    """


class UntestedFrameworkWarning(UserWarning):
    """A ``real=True`` check runs a framework release other than the one meshsim's adapter was
    tested with (``pip install 'meshsim[<framework>]'`` pins that one)."""


class RolesUnknown(UsageError):
    """The reference cannot say which ranks a data-flow check must compare.

    Raised by :func:`meshsim.assert_data_parallel` and :func:`meshsim.assert_gradient_sync` when
    the reference's ``data_parallel`` or ``gradient_reduce`` role is unknown (a plain torch
    mesh whose dim names fit no naming family): the check refuses rather than guess, and the
    message names the ``roles=`` argument that settles it. Not a finding about the program.
    """


class NothingCompared(MeshsimError, AssertionError):
    """A data-flow check found no two ranks to compare, so it proved nothing.

    Every ``gradient_reduce`` group is a single rank (no data parallelism, no context
    parallelism), or the world is one rank: there is no pair whose gradients or batches must
    agree. Not a finding about the program, and not a pass either: an ``AssertionError`` so a
    test that relies on the check does not pass silently.
    """


class DataflowMismatch(MeshsimError, AssertionError):
    """Ranks loaded, or reduced, what their roles forbid: the groups may be right, the use wrong.

    Raised by :func:`meshsim.assert_data_parallel` and :func:`meshsim.assert_gradient_sync`.
    ``problems`` holds one line per finding (the message shows the first few); each names the
    step or parameter, the ranks, what differs and the likely wiring mistake.
    """

    def __init__(self, problems: list[str], *, what: str = "data flow") -> None:
        shown = problems[:5]
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        head = f"{what} break the reference's roles ({len(problems)} problem"
        head += "s)" if len(problems) != 1 else ")"
        # The first problem leads: pytest's short summary and JUnit show the first line only.
        lead = problems[0].splitlines()[0] if problems else head
        super().__init__(lead + "\n" + head + ":\n  " + "\n  ".join(shown) + more)
        self.problems = list(problems)


class ReductionMismatch(DataflowMismatch):
    """A gradient was reduced over other groups than its parameter needs, or a collective ran
    over a group the layout does not define.

    Raised by :func:`meshsim.usage.assert_gradient_reductions`; ``problems`` holds one line
    per finding, each naming the parameter, the ranks, the groups observed and the kinds
    needed (or the stray collective and its call site).
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems, what="the gradient reductions")


class SerialMismatch(DataflowMismatch):
    """The N-rank step computed something its serial twin did not
    (:func:`meshsim.assert_matches_serial`).

    ``problems`` holds one line per finding, earliest first: the value, the ranks, its measured
    relation to the serial value and the likely mistake. ``comparison`` holds the full result.
    """

    def __init__(self, problems: list[str], comparison: Any) -> None:
        super().__init__(problems, what="the N-rank step and its serial twin")
        self.comparison = comparison
