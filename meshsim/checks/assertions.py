"""assert_layout: gather every rank's observations and fail loudly on any mismatch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshsim.checks.diff import diff
from meshsim.checks.observation import Observation, ObservedLayout
from meshsim.errors import LayoutMismatch
from meshsim.model.expected import Expected


def gather(observation: Observation) -> ObservedLayout:
    """Every rank's observation, on every rank (all_gather_object over the default group).

    On the fake backend nothing can be exchanged, so only this rank's observation comes back.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or str(dist.get_backend()) == "fake" or dist.get_world_size() == 1:
        return ObservedLayout.of(observation)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, observation)
    return ObservedLayout.of(everyone)


def assert_layout(
    observations: Observation | Iterable[Observation] | ObservedLayout,
    expected: Expected,
    kinds: Iterable[str] | None = None,
) -> ObservedLayout:
    """Diff observed groups against ``expected``; raise :class:`LayoutMismatch` on any difference.

    Called inside a rank with that rank's :class:`Observation`, it first gathers every rank's
    observation (a collective: call it on all ranks). Called in the parent with the list
    ``meshsim.run`` returned, it compares them directly. Returns what it compared.
    """
    observed = (
        gather(observations)
        if isinstance(observations, Observation)
        else ObservedLayout.of(observations)
    )
    found = diff(observed, expected, kinds)
    if found is not None:
        raise LayoutMismatch(found)
    return observed
