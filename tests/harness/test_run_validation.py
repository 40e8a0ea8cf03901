"""Bad input to meshsim.harness.run raises UsageError naming the cause and the fix."""

from __future__ import annotations

import math
import socket
import subprocess
import sys

import pytest

from meshsim.errors import MeshsimError, UsageError
from meshsim.harness import BACKENDS, run


def _noop() -> int:
    return 1


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one(world_size: int) -> None:
    with pytest.raises(UsageError, match="at least 1"):
        run(_noop, world_size, "fake")


@pytest.mark.parametrize("world_size", [2.0, "2", True, None])
def test_world_size_not_an_int(world_size: object) -> None:
    with pytest.raises(UsageError, match="must be an int"):
        run(_noop, world_size, "fake")  # type: ignore[arg-type]


def test_world_size_above_the_process_maximum() -> None:
    with pytest.raises(UsageError, match=r"maximum of 64.*MESHSIM_MAX_WORLD_SIZE.*fake"):
        run(_noop, 65, "threaded")


def test_maximum_is_configurable_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSIM_MAX_WORLD_SIZE", "3")
    with pytest.raises(UsageError, match="maximum of 3"):
        run(_noop, 4, "threaded")
    assert run(_noop, 3, "threaded") == [1, 1, 1]


def test_maximum_is_configurable_by_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshsim.harness

    monkeypatch.delenv("MESHSIM_MAX_WORLD_SIZE", raising=False)
    monkeypatch.setattr(meshsim.harness, "MAX_WORLD_SIZE", 2)
    with pytest.raises(UsageError, match="maximum of 2"):
        run(_noop, 3, "gloo")


def test_fake_tier_has_a_larger_maximum() -> None:
    with pytest.raises(UsageError, match="fake tier's maximum"):
        run(_noop, (1 << 20) + 1, "fake", ranks=[0])


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(UsageError) as info:
        run(_noop, 2, "mpi")
    for name in BACKENDS:
        assert name in str(info.value)


@pytest.mark.parametrize("timeout", [0, -1.5, math.nan, math.inf, "5", None])
def test_timeout_must_be_positive_and_finite(timeout: object) -> None:
    with pytest.raises(UsageError, match="timeout"):
        run(_noop, 2, "fake", timeout=timeout)  # type: ignore[arg-type]


def test_ranks_only_on_the_fake_tier() -> None:
    with pytest.raises(UsageError, match="only works with backend='fake'"):
        run(_noop, 2, "threaded", ranks=[0])


@pytest.mark.parametrize("ranks", [[], [2], [-1], [0, 0]])
def test_ranks_must_be_valid(ranks: list[int]) -> None:
    with pytest.raises(UsageError, match="ranks="):
        run(_noop, 2, "fake", ranks=ranks)


def test_fn_must_be_callable() -> None:
    with pytest.raises(UsageError, match="callable"):
        run(42, 2, "fake")  # type: ignore[arg-type]


def test_usage_error_is_a_value_error_and_a_meshsim_error() -> None:
    with pytest.raises(ValueError):
        run(_noop, 0, "fake")
    with pytest.raises(MeshsimError):
        run(_noop, 0, "fake")


def test_unpicklable_closure_variable_is_named() -> None:
    sock = socket.socket()  # sockets cannot be pickled, not even by dill
    try:

        def body() -> int:
            return sock.fileno()

        with pytest.raises(UsageError) as info:
            run(body, 2, "gloo", timeout=30)
    finally:
        sock.close()
    text = str(info.value)
    assert "'sock'" in text and "socket" in text
    assert "module level" in text and "backend='threaded'" in text


def test_unpicklable_argument_is_named() -> None:
    def gen() -> object:
        yield 1

    with pytest.raises(UsageError, match=r"args\[0\] \(generator\)"):
        run(_noop_with_arg, 2, "gloo", args=(gen(),))


def _noop_with_arg(x: object) -> int:
    return 1


def test_context_outside_a_rank_is_a_usage_error() -> None:
    from meshsim.harness import context

    with pytest.raises(UsageError, match="outside a rank"):
        context()


def test_importing_the_harness_does_not_import_torch() -> None:
    code = (
        "import sys, meshsim.harness, meshsim.harness.api, meshsim.harness.outcome; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_errors_subclass_the_builtins_they_mean() -> None:
    from meshsim.errors import (
        CollectiveDivergence,
        NotEnoughGPUs,
        RankFailure,
        RankTimeout,
        TeardownWarning,
    )

    assert issubclass(RankFailure, AssertionError) and issubclass(RankFailure, MeshsimError)
    assert issubclass(CollectiveDivergence, RankFailure)
    assert issubclass(RankTimeout, TimeoutError) and issubclass(RankTimeout, MeshsimError)
    assert issubclass(NotEnoughGPUs, RuntimeError) and issubclass(NotEnoughGPUs, MeshsimError)
    assert issubclass(TeardownWarning, RuntimeWarning)
