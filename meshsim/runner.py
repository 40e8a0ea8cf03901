"""Runs one pytest test body on every rank and turns rank outcomes into pytest outcomes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from meshsim.errors import NotEnoughGPUs, RankFailure, RankTimeout

#: Exception type names pytest uses for skip() and xfail() inside a test body.
_SKIP = "Skipped"
_XFAIL = "XFailed"


def run_test_body(
    testfunction: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    backend: str,
    world_size: int,
    timeout: float,
) -> None:
    """Call ``testfunction(**kwargs)`` on every rank, with ``rank`` set to each rank's own.

    Every other fixture value was computed once in the parent and travels to the ranks (it must
    pickle, with dill, on the process tiers). A skip or xfail raised on every failing rank
    becomes the item's skip or xfail; anything else fails the item with every rank's report.
    """
    __tracebackhide__ = True
    from meshsim.harness import run

    body = functools.partial(_on_rank, testfunction, dict(kwargs))
    body.__qualname__ = getattr(testfunction, "__qualname__", "test body")  # type: ignore[attr-defined]
    message = _run_and_explain(run, body, backend, world_size, timeout)
    if message is not None:  # outside the except blocks: no "during handling" chain
        pytest.fail(message, pytrace=False)


def _run_and_explain(
    run: Callable[..., Any], body: Callable[[], None], backend: str, world_size: int, timeout: float
) -> str | None:
    """Run the body; skip/xfail the item, or return the failure text (None when it passed)."""
    __tracebackhide__ = True
    try:
        run(body, world_size, backend=backend, timeout=timeout)
    except NotEnoughGPUs as error:
        pytest.skip(str(error))
    except RankFailure as error:
        failures = error.failures
        kinds = {o.error_type for o in failures}
        if failures and kinds <= {_SKIP, _XFAIL}:
            from meshsim.harness.outcome import compress_ranks

            reason = "; ".join(
                f"{'rank' if len(r) == 1 else 'ranks'} {compress_ranks(r)}: {m}"
                for m, r in _by_message(failures).items()
            )
            if kinds == {_SKIP}:
                pytest.skip(reason)
            pytest.xfail(reason)
        return f"{type(error).__name__}: {error}"
    except RankTimeout as error:
        return f"{type(error).__name__}: {error}"
    return None


def _on_rank(testfunction: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """The body each rank runs: the test function, with ``rank`` set to this rank."""
    from meshsim.fixtures import PerRank
    from meshsim.harness import context

    here = context()
    if "rank" in kwargs:
        kwargs = {**kwargs, "rank": here.rank}
    kwargs = {  # a distributed_fixture's values: each rank gets its own
        k: v.for_rank(here.rank, here.world_size) if isinstance(v, PerRank) else v
        for k, v in kwargs.items()
    }
    testfunction(**kwargs)


def _by_message(failures: tuple[Any, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for outcome in failures:
        out.setdefault(outcome.error_message or "", []).append(outcome.rank)
    return out
