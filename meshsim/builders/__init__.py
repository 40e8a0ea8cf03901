"""Builders: each framework's mesh recipe replayed with plain torch inside a rank, observed by kind.

A builder is the live half of a check. The reference (``meshsim.model``) says which ranks each
group must hold; a builder builds the groups the way the framework does, with torch's own
``init_device_mesh`` / slicing / ``_flatten`` / ``_unflatten`` / ``new_group``, and returns an
:class:`~meshsim.checks.Observation` whose group names are the convention's kind names, so
``meshsim.checks.diff(observations, expected)`` compares the two. Builders never read the
reference's groups: a builder that replayed them could never disagree.

This module stays torch-free; builder modules import torch and are loaded on first use, inside
a rank.

Example:
    Inside a rank of ``meshsim.harness.run``:

    ```python
    obs = build("megatron", 8, {"tensor_model_parallel_size": 2})
    obs.groups["tp"].members  # (0, 1) on ranks 0 and 1
    ```
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from meshsim.errors import UsageError

if TYPE_CHECKING:
    from meshsim.checks import Observation

#: framework -> module whose ``build(world_size, config) -> Observation`` replays its recipe.
BUILDERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "torch": "meshsim.builders.torch_mesh",
        "olmo-core": "meshsim.builders.olmo_core",
        "torchtitan": "meshsim.builders.torchtitan",
        "megatron": "meshsim.builders.megatron",
        "megatron-deepspeed": "meshsim.builders.megatron_deepspeed",
        "deepspeed": "meshsim.builders.deepspeed",
        "deepspeed-autoep": "meshsim.builders.deepspeed_autoep",
        "accelerate": "meshsim.builders.accelerate",
        "transformers": "meshsim.builders.transformers",
        "lightning": "meshsim.builders.lightning",
        "verl": "meshsim.builders.verl",
        "areal": "meshsim.builders.areal",
        "areal-fsdp": "meshsim.builders.areal_fsdp",
        "areal-archon": "meshsim.builders.areal_archon",
    }
)


def builder(framework: str) -> Any:
    """The module building ``framework``'s groups (imports torch)."""
    if framework not in BUILDERS:
        raise UsageError(
            f"no builder for framework {framework!r}; builders exist for: {', '.join(BUILDERS)}"
        )
    return importlib.import_module(BUILDERS[framework])


def build(framework: str, world_size: int, config: Mapping[str, Any]) -> Observation:
    """Build ``framework``'s groups for ``config`` on this rank and observe them by kind name.

    Call it on every rank of an initialised default process group (it creates groups, a
    collective act). Raises :class:`meshsim.builders._common.FrameworkRejection` where the
    framework itself rejects the config, or torch's own error where torch does.
    """
    observation: Observation = builder(framework).build(world_size, dict(config))
    return observation
