"""The registry of framework conventions: one module per framework, imported on first use.

Each convention module provides:

* ``expect(world_size, **config) -> Expected`` with the framework's own parameter names;
* ``configs(world_size, **options) -> Iterator[dict]``: every valid config for a world size;
* ``PARAMETERS``: config key -> one-line description (used by the CLI's flags and help);
* optionally ``SWEEP_FIXED``: config key -> why ``configs`` never varies it (it builds no group,
  takes one value, is a callable); every other key that changes the groups is varied, and
  ``meshsim.model.sweep.fixed_options`` reports the rest.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType, ModuleType
from typing import Any, Final, Protocol, cast

from meshsim.errors import LayoutError
from meshsim.model.expected import Expected

#: framework name -> module implementing its convention.
CONVENTIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "torch": "meshsim.model.conventions.torch_mesh",
        "olmo-core": "meshsim.model.conventions.olmo_core",
        "torchtitan": "meshsim.model.conventions.torchtitan",
        "megatron": "meshsim.model.conventions.megatron",
        "megatron-deepspeed": "meshsim.model.conventions.megatron_deepspeed",
        "deepspeed": "meshsim.model.conventions.deepspeed",
        "deepspeed-autoep": "meshsim.model.conventions.deepspeed_autoep",
        "accelerate": "meshsim.model.conventions.accelerate",
        "transformers": "meshsim.model.conventions.transformers",
        "lightning": "meshsim.model.conventions.lightning",
        "verl": "meshsim.model.conventions.verl",
        "areal": "meshsim.model.conventions.areal",
        "areal-fsdp": "meshsim.model.conventions.areal_fsdp",
        "areal-archon": "meshsim.model.conventions.areal_archon",
    }
)


class Convention(Protocol):
    PARAMETERS: Mapping[str, str]

    def expect(self, world_size: int, **config: Any) -> Expected: ...

    def configs(self, world_size: int, **options: Any) -> Iterator[dict[str, Any]]: ...


def convention(framework: str) -> Convention:
    """The module implementing ``framework``'s convention."""
    if framework not in CONVENTIONS:
        raise LayoutError(
            f"unknown framework {framework!r}; known frameworks: {', '.join(CONVENTIONS)}"
        )
    module: ModuleType = importlib.import_module(CONVENTIONS[framework])
    return cast(Convention, module)


def expect(framework: str, world_size: int, **config: Any) -> Expected:
    """Every group ``framework`` creates for ``config`` on ``world_size`` ranks.

    Example: ``expect("torch", world_size=8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    .groups("tp")`` is ``Groups([(0, 1, 2, 3), (4, 5, 6, 7)])``.
    """
    validate_world_size(world_size)
    return convention(framework).expect(world_size, **config)


def validate_world_size(world_size: int) -> None:
    """An int of at least 1 that the reference can hold (``layout.MAX_WORLD_SIZE``)."""
    from meshsim.model.layout import check_world_size

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world_size must be an integer >= 1, got {world_size!r}")
    check_world_size(world_size)


def reject_unknown(
    framework: str, config: Mapping[str, Any], parameters: Mapping[str, str]
) -> None:
    """Raise for config keys the framework does not take: the closest key it does take for
    each ("did you mean"), then all of them."""
    unknown = sorted(set(config) - set(parameters))
    if unknown:
        guesses = [
            f"{close[0]!r} for {key!r}"
            for key in unknown
            if (close := difflib.get_close_matches(key, list(parameters), n=1, cutoff=0.6))
        ]
        hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
        raise LayoutError(
            f"{framework} takes no config key(s) {unknown}{hint}; its keys are: "
            f"{', '.join(parameters)}"
        )


def upstream_error(upstream: str) -> Callable[[str], LayoutError]:
    """A maker of the LayoutErrors of a framework that raises one exception type for its config
    mistakes: ``_error = upstream_error("OLMoConfigurationError")``, then ``raise _error(...)``."""
    return functools.partial(LayoutError, upstream=upstream)


def check(condition: bool, message: str, upstream: str | None = "AssertionError") -> None:
    """A framework's ``assert`` (or ``if ...: raise``) on a config, kept as a LayoutError naming
    the exception it raises (``python -O`` would strip an ``assert``)."""
    if not condition:
        raise LayoutError(message, upstream=upstream)
