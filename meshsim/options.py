"""The numbers CLI flags and pytest options take, parsed and refused in one wording."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N", int, float)


def integer(
    flag: str,
    *,
    minimum: int | None = None,
    error: Callable[[str], Exception] = ValueError,
    echo_text: bool = False,
) -> Callable[[str], int]:
    """A parser of ``flag``'s integer value, at least ``minimum`` when given.

    ``error`` builds what is raised: argparse reports an ``ArgumentTypeError`` as its usage
    line, pytest a ``UsageError`` as its own. ``echo_text`` quotes a value under the bound as
    typed (``00``) rather than as parsed (``0``).

    Example: ``integer("--jobs", minimum=1)("0")`` raises ``--jobs must be >= 1, got 0``.
    """
    return _number(flag, int, "an integer", minimum, False, error, echo_text)


def seconds(flag: str, *, error: Callable[[str], Exception] = ValueError) -> Callable[[str], float]:
    """A parser of ``flag``'s duration: a number of seconds above zero.

    Example: ``seconds("--timeout")("0.0")`` raises ``--timeout must be > 0, got 0.0``.
    """
    return _number(flag, float, "seconds", 0.0, True, error, True)


def _number(
    flag: str,
    convert: Callable[[str], _N],
    unit: str,
    minimum: _N | None,
    strict: bool,
    error: Callable[[str], Exception],
    echo_text: bool,
) -> Callable[[str], _N]:
    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise error(f"{flag} takes {unit}, got {text!r}") from None
        if minimum is not None and (value <= minimum if strict else value < minimum):
            bound = f"> {minimum:g}" if strict else f">= {minimum}"
            raise error(f"{flag} must be {bound}, got {text if echo_text else value}")
        return value

    return parse


# -- environment options -------------------------------------------------------------------
#: The numeric ``MESHSIM_*`` environment options: name -> (parser, default). Each is read where
#: it is used; :func:`check_environment` parses them all up front, so a typo
#: (``MESHSIM_MAX_WORLD_SIZE=abc``) is one line naming the variable, before any work starts.
ENVIRONMENT: dict[str, tuple[Callable[[str], float], float]] = {
    "MESHSIM_MAX_WORLD_SIZE": (integer("MESHSIM_MAX_WORLD_SIZE", minimum=1), 64),
    "MESHSIM_MAX_FAKE_WORLD_SIZE": (integer("MESHSIM_MAX_FAKE_WORLD_SIZE", minimum=1), 1 << 20),
    "MESHSIM_POOL_SIZE": (integer("MESHSIM_POOL_SIZE", minimum=0), 8),
    "MESHSIM_BOOT_TIMEOUT": (seconds("MESHSIM_BOOT_TIMEOUT"), 120.0),
}
#: Text options with a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {"MESHSIM_POOL_BOOT": ("template", "spawn")}


def environment(name: str, *, strict: bool = True) -> float:
    """The value of the numeric environment option ``name`` (its default when unset or empty).

    ``strict=False`` returns the default for a malformed value instead of raising: for
    module constants read at import, where an exception would break ``import meshsim``; the
    run that uses the option calls with ``strict=True`` (or :func:`check_environment`).
    """
    from meshsim.errors import UsageError

    parse, default = ENVIRONMENT[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        if not strict:
            return default
        raise UsageError(f"environment variable {exc}; unset it or fix it") from None


def check_environment(*, torch_release: bool = True) -> None:
    """Raise a one-line UsageError for the first malformed ``MESHSIM_*`` option
    (``MESHSIM_TORCH_RELEASE`` too unless ``torch_release`` is False: the harness runs bodies
    whatever release the reference describes)."""
    from meshsim.errors import LayoutError, UsageError

    for name in ENVIRONMENT:
        environment(name)
    for name, allowed in CHOICES.items():
        raw = os.environ.get(name, "").strip()
        if raw and raw not in allowed:
            raise UsageError(
                f"environment variable {name}={raw!r} is not one of {', '.join(allowed)}"
            )
    if not torch_release:
        return
    from meshsim.model import torch_release as release

    try:
        release.target()
    except LayoutError as exc:
        raise UsageError(f"environment variable {exc}") from None
