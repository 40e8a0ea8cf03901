"""The numbers CLI flags and pytest options take, parsed and refused in one wording."""

from __future__ import annotations

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
