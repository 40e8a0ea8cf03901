"""Frameworks' own training steps, run under :func:`meshsim.assert_matches_serial`.

``meshsim verify F --equivalence --real`` runs the framework's own step where one is here
(its parallelize functions, loss, gradient clipping and optimizer), instead of meshsim's
recipe on the framework's meshes: that is where wrong groups are *used*. Each module gives
``refusal(world_size, config)`` (why a layout is not run, or None), ``batch(step)`` (a step's
global batch), ``step(config, before=None)`` (the step function) and ``WHAT_RUNS``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

#: framework -> module of its own step.
STEPS = {
    "torchtitan": "meshsim.own_steps.torchtitan",
    "olmo-core": "meshsim.own_steps.olmo_core",
    "megatron": "meshsim.own_steps.megatron",
    "deepspeed": "meshsim.own_steps.deepspeed",
    "accelerate": "meshsim.own_steps.accelerate",
    "lightning": "meshsim.own_steps.lightning",
}


def own_step(framework: str) -> ModuleType | None:
    """The module running ``framework``'s own step, or None where meshsim has none yet."""
    name = STEPS.get(framework)
    return None if name is None else importlib.import_module(name)


_MISSING = object()


@contextlib.contextmanager
def put_back(before: Callable[[], None] | None, patchable: Sequence[str]) -> Iterator[None]:
    """Restore what ``before`` (a planted bug) replaced on ``patchable`` (``"module"`` or
    ``"module:attribute"``): a warm gloo worker runs the next layout, and the serial twin runs
    in the caller's process."""
    if before is None:
        yield
        return
    owners = []
    for name in patchable:
        module, _, attribute = name.partition(":")
        owner = importlib.import_module(module)
        owners.append(getattr(owner, attribute) if attribute else owner)
    saved = [(owner, dict(vars(owner))) for owner in owners]
    try:
        yield
    finally:
        for owner, kept in saved:
            for key in set(vars(owner)) - set(kept):
                delattr(owner, key)
            for key, value in kept.items():
                if vars(owner).get(key, _MISSING) is not value:
                    setattr(owner, key, value)
