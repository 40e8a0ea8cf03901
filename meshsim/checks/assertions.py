"""assert_layout: gather every rank's observations and fail loudly on any mismatch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshsim.checks.diff import ObservedLayout, diff
from meshsim.checks.observation import Observation
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
    observations, names = _check_arguments(observations, expected, kinds)
    observed = (
        gather(observations)
        if isinstance(observations, Observation)
        else ObservedLayout.of(observations)
    )
    found = diff(observed, expected, names)
    if found is not None:
        raise LayoutMismatch(found)
    return observed


def _check_arguments(
    observations: Any, expected: object, kinds: object
) -> tuple[Any, list[str] | None]:
    """Refuse arguments of the wrong kind with a UsageError naming them, before anything is
    gathered (a TypeError deep inside the diff would name none of them). Returns the
    observations (an iterator read into a list) and ``kinds`` as a list (one name given as a
    string is one kind, not its letters)."""
    from meshsim.errors import UsageError

    if not isinstance(expected, Expected):
        raise UsageError(
            f"assert_layout's expected must be a meshsim.Expected (from meshsim.expect), got "
            f"{type(expected).__name__} {expected!r:.60}"
        )
    if not isinstance(observations, (Observation, ObservedLayout)):
        if isinstance(observations, (str, bytes)) or not isinstance(observations, Iterable):
            raise UsageError(
                "assert_layout takes an Observation (meshsim.observe), a list of them or an "
                f"ObservedLayout, got {type(observations).__name__} {observations!r:.60}"
            )
        observations = list(observations)
        wrong = sorted({type(o).__name__ for o in observations if not isinstance(o, Observation)})
        if wrong:
            raise UsageError(
                f"assert_layout takes Observation objects (from meshsim.observe), got {wrong}"
            )
    if kinds is None:
        return observations, None
    names = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(names, Iterable):
        raise UsageError(f"kinds must be kind or role names (strings), got {kinds!r}")
    names = list(names)
    if not all(isinstance(k, str) for k in names):
        raise UsageError(f"kinds must be kind or role names (strings), got {kinds!r}")
    return observations, names


def assert_within_nodes(
    layout: Expected | Observation | Iterable[Observation] | ObservedLayout,
    kinds: str | Iterable[str],
    gpus_per_node: int,
) -> None:
    """Raise :class:`~meshsim.errors.GroupsCrossNodes` when a group of ``kinds`` spans nodes.

    A node is ``rank // gpus_per_node``. ``layout`` is the reference (the plan: "tensor
    parallelism stays inside a node") or what ranks observed (the live mesh: a list from
    ``meshsim.run``, or one rank's Observation, gathered first, collectively). ``kinds`` takes
    kind or role names (``"tensor"``).

    Example: ``assert_within_nodes(meshsim.expect("megatron", 16, tensor_model_parallel_size=8,
    order="tp-pp-dp"), "tensor", 8)`` passes; with ``gpus_per_node=4`` it names the groups.
    """
    from meshsim.errors import GroupsCrossNodes, UsageError
    from meshsim.model.groups import format_groups

    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise UsageError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    problems = []
    for name in [kinds] if isinstance(kinds, str) else list(kinds):
        groups = _groups_of(layout, name)
        crossing = [g for g in groups if len({r // gpus_per_node for r in g}) > 1]
        if crossing:
            first = crossing[0]
            nodes = sorted({r // gpus_per_node for r in first})
            problems.append(
                f"{name}: {len(crossing)} of {len(groups)} groups cross nodes of {gpus_per_node} "
                f"GPUs, e.g. {first} spans nodes {', '.join(map(str, nodes))}; crossing: "
                f"{format_groups(crossing, 4)}"
            )
    if problems:
        raise GroupsCrossNodes("\n".join(problems))


def _groups_of(layout: Any, name: str) -> list[tuple[int, ...]]:
    """The groups of ``name`` in the reference, or as the ranks observed them."""
    from meshsim.errors import UsageError

    if isinstance(layout, Expected):
        return [tuple(int(r) for r in g) for g in layout.groups(name)]
    observed = gather(layout) if isinstance(layout, Observation) else ObservedLayout.of(layout)
    found = sorted({o.groups[name].members for o in observed if name in o.groups})
    if not found:
        raise UsageError(f"no rank observed a group named {name!r}; observed: {observed.names()}")
    return found
