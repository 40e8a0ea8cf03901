"""Which ``backend_override`` forms ``init_device_mesh`` (torch 2.13) accepts, and how it fails.

The override never changes which ranks share a group, only which backend builds it, so the
reference's only job here is the verdict: keys are a dim's index or name (not both, nothing
else: ``RuntimeError``, found while normalising, before any group exists); each value is a
backend name, an ``Options`` object, or a ``(backend, options)`` pair, and a bad value only
fails when the dim's groups are created (``TypeError`` for a non-pair, ``ValueError`` for a pair
of the wrong length or a non-string backend, ``AttributeError`` for options that are not
``Options``, ``AssertionError`` for an unknown backend name). Whether this machine can build the
named backend (NCCL without a GPU, gloo on a fake world) is outside the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release

#: c10d's built-in backend names, plus ``fake`` (registered by torch's fake_pg module).
BACKENDS: Final = frozenset({"gloo", "nccl", "ucc", "mpi", "xccl", "fake"})

BackendConfig = tuple[str | None, Any]


def normalize(
    override: Any, ndim: int, names: Sequence[str] | None
) -> tuple[BackendConfig, ...] | None:
    """torch's per-dim ``(backend, options)`` for ``override``, or the LayoutError it raises."""
    if override is None:
        return None
    if not isinstance(override, Mapping):
        raise LayoutError(
            f"backend_override must be a dict of dim index or name -> backend, got "
            f"{type(override).__name__}"
        )
    left = dict(override)  # torch pops from the caller's dict; the model must not
    raw: list[Any] = []
    for index, name in zip_longest(range(ndim), tuple(names or ())):
        if name is not None and name in left:
            if index in left:
                raise LayoutError(
                    f"Found redundant dim index {index} and name {name} in backend_override",
                    upstream="RuntimeError",
                )
            raw.append(left.pop(name))
        elif index in left:
            raw.append(left.pop(index))
        else:
            raw.append((None, None))
    if left:
        raise LayoutError(
            f"Found invalid keys in backend_override: got {list(left)}, expected integers in "
            f"range [0, {ndim}) or one of {tuple(names or ())}",
            upstream="RuntimeError",
        )
    return tuple(_value(v, names[i] if names else str(i)) for i, v in enumerate(raw))


def _value(value: Any, dim: str) -> BackendConfig:
    if isinstance(value, str):
        return (_backend(value, dim), None)
    if _is_options(value):
        return (None, value)
    if not isinstance(value, (tuple, list)):
        raise LayoutError(
            f"backend_override[{dim!r}] = {value!r}: cannot unpack non-iterable "
            f"{type(value).__name__} object into (backend, options)",
            upstream="TypeError",
        )
    if len(value) != 2:
        raise LayoutError(
            f"backend_override[{dim!r}] = {value!r}: expected (backend, options), got "
            f"{len(value)} values",
            upstream="ValueError",
        )
    backend, options = value
    if backend is not None and not isinstance(backend, str):
        raise LayoutError(
            f"backend_override[{dim!r}]: Backend constructor parameter must be string-ish, got "
            f"{backend!r}",
            upstream="ValueError",
        )
    if options and not _is_options(options):
        raise LayoutError(
            f"backend_override[{dim!r}]: options {options!r} is not a c10d Options object "
            f"(no '_timeout')",
            upstream=torch_release.backend_options_error(),
        )
    return (None if backend is None else _backend(backend, dim), options or None)


def _backend(name: str, dim: str) -> str:
    """A backend name, or torch's ``"cpu:gloo,cuda:nccl"`` per-device form."""
    parts = [p.split(":", 1)[-1].strip().lower() for p in name.split(",")] if name else [""]
    unknown = [p for p in parts if p not in BACKENDS]
    if unknown:
        raise LayoutError(
            f"backend_override[{dim!r}]: Unknown backend type {name}; known: {sorted(BACKENDS)}",
            upstream="AssertionError",
        )
    return name


def _is_options(value: Any) -> bool:
    """c10d ``Backend.Options`` (and subclasses) carry ``_timeout``; torch reads it."""
    return not isinstance(value, (str, tuple, list)) and hasattr(value, "_timeout")
