"""Frameworks' own training steps, run under :func:`meshsim.assert_matches_serial`.

``meshsim verify F --equivalence --real`` runs the framework's own step where one is here
(its parallelize functions, loss, gradient clipping and optimizer), instead of meshsim's
recipe on the framework's meshes: that is where wrong groups are *used*. Each module gives
``refusal(world_size, config)`` (why a layout is not run, or None), ``batch(step)`` (a step's
global batch), ``step(config, before=None)`` (the step function) and ``WHAT_RUNS``.
"""

from __future__ import annotations

import importlib
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
