"""Hook for real-framework adapters: build groups with the framework's own code, not meshsim's.

An adapter module ``meshsim.builders.real.<name>`` provides ``build(world_size, config) ->
Observation`` like a builder, but calls the framework (``olmo_core.distributed.parallel
.build_world_mesh``, ``megatron.core.parallel_state.initialize_model_parallel``, ...) and observes
what it made. ``meshsim.verify(..., real=True)`` uses it, after checking (without importing
them) that the adapter and the framework's packages are installed, so a missing framework is a
usage error naming the pip extra instead of a crash inside every rank.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

#: framework -> adapter module (``verify(real=True)`` checks that it exists).
REAL_BUILDERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "olmo-core": "meshsim.builders.real.olmo_core",
        "torchtitan": "meshsim.builders.real.torchtitan",
        "megatron": "meshsim.builders.real.megatron",
        "deepspeed": "meshsim.builders.real.deepspeed",
        "deepspeed-autoep": "meshsim.builders.real.deepspeed_autoep",
        "accelerate": "meshsim.builders.real.accelerate",
        "transformers": "meshsim.builders.real.transformers",
        "lightning": "meshsim.builders.real.lightning",
        "verl": "meshsim.builders.real.verl",
        "areal-fsdp": "meshsim.builders.real.areal_fsdp",
        "areal-archon": "meshsim.builders.real.areal_archon",
    }
)
# megatron-deepspeed has no adapter: its code is not on the package index (issue 21 models its
# lines from their source instead).

#: framework -> the ``meshsim[...]`` extra that installs it (see pyproject.toml).
EXTRAS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "olmo-core": "olmo-core",
        "torchtitan": "torchtitan",
        "megatron": "megatron",
        "megatron-deepspeed": "deepspeed",
        "deepspeed": "deepspeed",
        "deepspeed-autoep": "deepspeed",
        "accelerate": "accelerate",
        "transformers": "transformers",
        "lightning": "lightning",
        "verl": "verl",
        "areal-fsdp": "areal",
        "areal-archon": "areal",
    }
)


#: framework -> top-level packages the real framework needs importable.
REQUIRES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "olmo-core": ("olmo_core",),
        "torchtitan": ("torchtitan",),
        "megatron": ("megatron",),
        "megatron-deepspeed": ("megatron", "deepspeed"),
        "deepspeed": ("deepspeed",),
        "deepspeed-autoep": ("deepspeed",),
        "accelerate": ("accelerate",),
        "transformers": ("transformers", "accelerate"),
        "lightning": ("lightning",),
        "verl": ("verl",),
        "areal-fsdp": ("areal",),
        "areal-archon": ("areal",),
    }
)


#: framework -> (pinned release, the torch releases it declares: first, first excluded). Only
#: ai2-olmo-core pins torch (3.0.0: torch>=2.10,<2.14); torchtitan 0.3.0, megatron-core 0.16.1
#: and deepspeed 0.19.8 install on every release meshsim supports, 2.15 included.
TORCH_RANGES: Final[Mapping[str, tuple[str, tuple[int, int], tuple[int, int]]]] = MappingProxyType(
    {
        "olmo-core": ("ai2-olmo-core 3.0.0", (2, 10), (2, 14)),
        # areal 1.0.4 declares torch>=2.9.1,<2.11: the torch 2.10 environment runs it.
        "areal-fsdp": ("areal 1.0.4", (2, 9), (2, 11)),
        "areal-archon": ("areal 1.0.4", (2, 9), (2, 11)),
    }
)


def torch_mismatch(framework: str) -> str | None:
    """Why the pinned framework cannot be installed next to the installed torch, or None."""
    from meshsim.model import torch_release

    found = torch_release.installed()
    if framework not in TORCH_RANGES or found is None:
        return None
    pinned, first, stop = TORCH_RANGES[framework]
    if first <= found < stop:
        return None
    return (
        f"{pinned} requires torch>={first[0]}.{first[1]},<{stop[0]}.{stop[1]} and this is torch "
        f"{found[0]}.{found[1]}, so pip cannot install it here; run --real under a torch in "
        f"that range, or drop --real (real=False) to verify meshsim's builder of its recipe"
    )


def unavailable(framework: str) -> str | None:
    """Why ``verify(real=True)`` cannot run ``framework`` here (None when it can).

    Looks modules up with ``find_spec`` only: nothing is imported, torch included.
    """
    module = REAL_BUILDERS.get(framework)
    if framework == "torch":
        return "--real (real=True): " + install_hint(framework)
    if module is None:
        return (
            f"--real (real=True): meshsim has no adapter that runs the real {framework} code, "
            "only its reference and a plain-torch builder of its recipe; drop --real "
            "(real=False) to verify that builder"
        )
    if importlib.util.find_spec(module) is None:
        return (
            f"--real (real=True) needs meshsim's adapter for the real {framework} code "
            f"({module}), which this install lacks; {install_hint(framework)}"
        )
    missing = [p for p in REQUIRES.get(framework, ()) if importlib.util.find_spec(p) is None]
    mismatch = torch_mismatch(framework)
    if missing and mismatch:
        return f"--real (real=True) runs {framework} itself, and {missing} is not installed: " + (
            mismatch
        )
    if missing:
        return f"--real (real=True) runs {framework} itself, and {missing} is not installed; " + (
            install_hint(framework)
        )
    return None


def outside_adapter(framework: str, config: Mapping[str, object]) -> str | None:
    """Why the adapter cannot build ``config`` although the reference models it, or None.

    The reference models older or forked lines of a framework that the installed package does
    not contain (torchtitan's ``intermediate`` / ``legacy`` / ``hyper_parallel``); ``sweep
    --real`` leaves those layouts out and says so, and the adapter refuses them with this text.
    """
    if framework == "torchtitan":
        version = config.get("version", "current")
        if version != "current":
            return (
                f"the real torchtitan adapter runs the installed torchtitan, whose ParallelDims "
                f"is the 'current' multi-view convention; version={version!r} is modelled by "
                "meshsim's reference only (use real=False)"
            )
        if config.get("etp", 1) != 1:
            return (
                f"torchtitan's current ParallelDims has no expert tensor parallel degree; got "
                f"etp={config['etp']}"
            )
    if framework == "accelerate":
        return _other_accelerate_release(config)
    return None


def _other_accelerate_release(config: Mapping[str, object]) -> str | None:
    """The reference models accelerate 1.10 and 1.15; the adapter runs the installed one."""
    from importlib.metadata import PackageNotFoundError, version

    from meshsim.model.conventions.accelerate import version_of

    try:
        found = ".".join(version("accelerate").split(".")[:2])
    except PackageNotFoundError:
        return None
    wanted = version_of(config)
    if wanted == found:
        return None
    return (
        f"the real accelerate adapter runs the installed accelerate {found}; version={wanted!r} "
        f"is modelled by meshsim's reference only (use real=False, or install "
        f"accelerate=={wanted}.0)"
    )


#: The distribution behind each module in ``REQUIRES`` (its version is what ``TESTED_VERSIONS``
#: in ``_shims`` pins).
_DISTRIBUTIONS: Final[Mapping[str, str]] = MappingProxyType(
    {"olmo_core": "ai2-olmo-core", "megatron": "megatron-core"}
)


def untested_version(framework: str) -> str | None:
    """Which installed release of ``framework`` meshsim's adapter was not tested with, said as
    a user needs it (None when every one is the tested release, or the framework is absent).

    An adapter reaches into a framework's own code, so another release may fail inside it with
    an AttributeError that names nothing (transformers 5.17 has no ``dp_replicate``)."""
    from importlib import metadata

    from meshsim.builders.real._shims import TESTED_VERSIONS

    for module in REQUIRES.get(framework, ()):
        distribution = _DISTRIBUTIONS.get(module, module)
        tested = TESTED_VERSIONS.get(distribution)
        try:
            have = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        if tested is not None and have != tested:
            return (
                f"{distribution} {have} is installed and meshsim's {framework} adapter is "
                f"tested with {tested}; an error inside {distribution}'s code may come from "
                f"that, {install_hint(framework)}"
            )
    return None


def require(framework: str) -> None:
    """Before a ``real=True`` check starts a rank: ``UsageError`` with ``unavailable``'s reason,
    or an ``UntestedFrameworkWarning`` with ``untested_version``'s note."""
    import warnings

    from meshsim.errors import UntestedFrameworkWarning, UsageError

    reason = unavailable(framework)
    if reason is not None:
        raise UsageError(reason)
    note = untested_version(framework)
    if note is not None:
        warnings.warn(note, UntestedFrameworkWarning, stacklevel=3)


def install_hint(framework: str) -> str:
    """How to get the real framework: ``pip install 'meshsim[olmo-core]'`` and the like."""
    if framework == "torch":
        return "torch's DeviceMesh is already what the torch builder runs; drop --real (real=False)"
    extra = EXTRAS.get(framework)
    if extra is None:
        return f"meshsim has no real-framework support for {framework!r}"
    return f"install the framework with: pip install 'meshsim[{extra}]'"
