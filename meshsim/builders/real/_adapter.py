"""Shared by the real-framework adapters: check config keys, name a framework's own refusals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from meshsim.builders._common import FrameworkRejection
from meshsim.errors import UsageError


@contextlib.contextmanager
def framework_refusals() -> Iterator[None]:
    """Turn any exception the framework's own code raises into a ``FrameworkRejection``.

    ``meshsim.verify`` passes a config that both the reference and the builder reject, when the
    exception type the builder reports (``upstream``) is the one the reference says the
    framework raises. A real framework raises its own types (``OLMoConfigurationError``,
    ``ZeroDivisionError`` from a degree of 0, ...) which verify would otherwise take for a
    builder crash; wrapping them keeps the type's name and message. Example: OLMo's
    ``build_world_mesh(tp=TensorParallelConfig(degree=2))`` without a dp config raises
    ``OLMoConfigurationError``; it comes out as a ``FrameworkRejection`` whose ``upstream`` is
    ``"OLMoConfigurationError"``.
    """
    try:
        yield
    except FrameworkRejection:
        raise
    except Exception as error:
        raise FrameworkRejection(
            f"{type(error).__name__}: {error}", upstream=type(error).__name__
        ) from error


def check_keys(framework: str, config: Mapping[str, Any]) -> None:
    """Refuse config keys meshsim's convention for ``framework`` does not define.

    An adapter translates only the convention's keys (``PARAMETERS``); silently dropping a
    misspelt one would build the default layout and report a confusing mismatch instead.
    """
    from meshsim.model.conventions import convention

    parameters = convention(framework).PARAMETERS
    unknown = sorted(set(config) - set(parameters))
    if unknown:
        raise UsageError(
            f"{framework} takes no config key(s) {unknown}; its keys are: {', '.join(parameters)}"
        )
