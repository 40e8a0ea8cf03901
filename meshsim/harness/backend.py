"""What ``meshsim.run`` hands a tier (``Job``) and what every tier provides (``Backend``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshsim.harness.outcome import RunResult


@dataclass(frozen=True)
class Job:
    """One validated ``meshsim.run`` call."""

    fn: Callable[..., Any]
    world_size: int
    backend: str
    timeout: float
    ranks: tuple[int, ...]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """A tier: runs ``job.fn`` on every rank of ``job.ranks`` and reports what happened.

    Contract: return a ``RunResult`` when every rank returned; raise ``RankFailure`` /
    ``RankTimeout`` (from ``meshsim.errors``) otherwise; leave no process, thread or temp
    file of the job behind either way.
    """

    name: str

    def run(self, job: Job) -> RunResult[Any]: ...
