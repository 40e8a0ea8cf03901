"""Each rank's environment and working directory behave as a process's would, on every tier.

Trainers read ``int(os.environ["LOCAL_RANK"])``. A gloo worker has torchrun's variables. Fake and
threaded ranks run in the caller's process, and had none of them; one rank's writes reached the
others and the caller.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import meshsim

TIERS = ["fake", "threaded", "gloo"]


def _variables_and_writes() -> tuple[str, ...]:
    import time

    os.environ["MESHSIM_TEST_MINE"] = os.environ["RANK"]
    time.sleep(0.05)  # the other threaded ranks write meanwhile
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MESHSIM_TEST_MINE")
    return (*(os.environ[n] for n in names), str(os.getenv("MESHSIM_TEST_MINE")))


@pytest.mark.parametrize("backend", TIERS)
def test_rank_variables_and_a_ranks_own_writes(backend: str) -> None:
    seen = meshsim.run(_variables_and_writes, 4, backend=backend)
    assert seen == [(str(r), str(r), "4", "4", str(r), str(r)) for r in range(4)]
    assert "MESHSIM_TEST_MINE" not in os.environ  # the caller's environment is untouched
    assert "RANK" not in os.environ or os.environ["RANK"] != "3"


def _chdir(target: str) -> str:
    os.chdir(target)
    return os.getcwd()


def test_chdir_on_the_fake_tier_is_undone_after_each_rank(tmp_path: Path) -> None:
    before = os.getcwd()
    assert meshsim.run(_chdir, 2, backend="fake", args=(str(tmp_path),)) == [str(tmp_path)] * 2
    assert os.getcwd() == before


def test_chdir_on_the_threaded_tier_is_refused_with_the_reason(tmp_path: Path) -> None:
    before = os.getcwd()
    with pytest.raises(meshsim.RankFailure) as caught:
        meshsim.run(_chdir, 2, backend="threaded", args=(str(tmp_path),))
    assert "threaded ranks are threads of one process and share one working directory" in str(
        caught.value
    )
    assert os.getcwd() == before


def test_chdir_on_gloo_is_the_ranks_own(tmp_path: Path) -> None:
    before = os.getcwd()
    assert meshsim.run(_chdir, 2, backend="gloo", args=(str(tmp_path),)) == [str(tmp_path)] * 2
    assert os.getcwd() == before


def _compiled_step() -> tuple[float, str]:
    import torch

    os.environ["MESHSIM_TEST_MINE"] = os.environ["RANK"]
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    return round(float(f(torch.ones(3)).sum()), 5), os.environ["MESHSIM_TEST_MINE"]


def test_torch_compile_on_cpu_runs_in_threaded_ranks() -> None:
    """Inductor sets ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`` and its compiled C++ reads it
    back with ``getenv``: when a rank's copy of the environment swallowed torch's write, every
    CPU ``torch.compile`` in a threaded rank (and in ``assert_matches_serial``'s serial twin)
    failed with "must be set" (found running torchtitan's own step). torch's writes now reach
    the process's environment; a rank's own writes still stay its own."""
    import torch

    pytest.importorskip("torch._inductor")
    expected = round(float((torch.sin(torch.ones(3)) * 2 + 1).sum()), 5)
    try:
        seen = meshsim.run(_compiled_step, 2, backend="threaded", timeout=600)
    finally:  # threads torch starts once per process for all compiles: torch's, not a rank's
        _stop_tqdm_monitor()
        _stop_inductor_compile_pool()
    assert seen == [(expected, "0"), (expected, "1")]
    assert "MESHSIM_TEST_MINE" not in os.environ


def _stop_inductor_compile_pool() -> None:
    """A cold compile cache (a fresh CI machine) makes torch 2.15's inductor start its
    process-wide compile thread pool; a warm one does not, so the thread check must not
    depend on which the machine had."""
    from torch._inductor.async_compile import AsyncCompile

    pool = getattr(AsyncCompile, "pool", None)
    if pool is not None and hasattr(pool, "cache_info") and pool.cache_info().currsize:
        pool().shutdown(wait=True)
        pool.cache_clear()


def _stop_tqdm_monitor() -> None:
    try:
        import tqdm
    except ImportError:  # no tqdm, no progress bars: inductor starts no monitor
        return
    monitor = getattr(tqdm.tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm.tqdm.monitor = None
