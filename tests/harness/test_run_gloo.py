"""The gloo tier: a warm pool of real processes, real gloo, and every way a rank can fail."""

from __future__ import annotations

import os
import warnings

import pytest

from meshsim.errors import (
    NotEnoughGPUs,
    RankFailure,
    TeardownWarning,
)
from meshsim.harness import RankContext, context, rendezvous, run, shutdown
from meshsim.harness.pool import pool_pids

from .conftest import child_pids, process_alive


def _gone(outcomes) -> None:  # type: ignore[no-untyped-def]
    """Every worker that ran a failed job's rank is gone unless it went back to the pool."""
    pool = set(pool_pids())
    for o in outcomes:
        assert o.pid is not None
        assert o.pid in pool or not process_alive(o.pid), f"rank {o.rank} (pid {o.pid}) lingers"


def test_values_context_args_and_closures() -> None:
    offset = 100

    def body(a: int, *, b: int) -> tuple:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return context(), dist.get_rank() + offset + a + b, t.item(), os.getpid()

    out = run(body, 2, "gloo", timeout=120, args=(10,), kwargs={"b": 1})
    assert [v[0] for v in out] == [RankContext(r, 2, "gloo") for r in range(2)]
    assert [v[1] for v in out] == [111, 112]
    assert [v[2] for v in out] == [1.0, 1.0]
    assert {v[3] for v in out} <= set(pool_pids())
    assert [o.pid for o in out.outcomes] == [v[3] for v in out]


def test_second_call_reuses_warm_workers() -> None:
    def body() -> tuple:
        import sys

        return os.getpid(), "torch" in sys.modules

    first = run(body, 2, "gloo", timeout=120)
    warm = set(pool_pids())
    assert {p for p, _ in first} <= warm
    second = run(body, 2, "gloo", timeout=30)
    # Workers already alive and idle before the call (earlier tests may have left more than
    # two): no new interpreter, no torch import.
    assert {p for p, _ in second} <= warm
    assert all(imported for _, imported in second)


def test_raising_ranks_are_merged_and_workers_stay_warm() -> None:
    def body() -> int:
        import torch.distributed as dist

        if dist.get_rank() >= 2:
            raise AssertionError("only ranks 0 and 1 may pass")
        return dist.get_rank()

    with pytest.raises(RankFailure) as info:
        run(body, 4, "gloo", timeout=60)
    text = str(info.value)
    assert "ranks 2, 3: AssertionError: only ranks 0 and 1 may pass" in text
    assert "in body" in info.value.failures[0].traceback
    assert "meshsim/harness" not in info.value.failures[0].traceback
    assert {o.pid for o in info.value.outcomes} <= set(pool_pids())  # clean teardown: reused


def test_exit_code_is_reported() -> None:
    def body() -> None:
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailure) as info:
        run(body, 2, "gloo", timeout=60)
    assert "rank 1 died: exited with code 3" in str(info.value)
    dead = info.value.outcomes[1]
    assert (dead.status, dead.exit_code, dead.signal_name) == ("died", 3, None)
    _gone(info.value.outcomes)


def test_segfault_is_reported_with_the_crash_stack() -> None:
    def body() -> int:
        import ctypes

        import torch.distributed as dist

        if dist.get_rank() == 1:
            ctypes.string_at(0)
        return 0

    with pytest.raises(RankFailure) as info:
        run(body, 2, "gloo", timeout=60)
    assert "rank 1 died: killed by SIGSEGV" in str(info.value)
    dead = info.value.outcomes[1]
    assert dead.signal_name == "SIGSEGV" and "Segmentation fault" in (dead.output or "")
    assert "in body" in (dead.output or "")  # faulthandler's stack of the crash
    _gone(info.value.outcomes)


def test_sigkill_is_reported() -> None:
    def body() -> None:
        import signal

        import torch.distributed as dist

        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(RankFailure, match="rank 0 died: killed by SIGKILL") as info:
        run(body, 2, "gloo", timeout=60)
    _gone(info.value.outcomes)


def test_death_during_teardown_is_a_warning_not_a_failure() -> None:
    def body() -> int:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            # The worker's teardown calls dist.destroy_process_group(): make it abort, like the
            # "terminate called without an active exception" seen in ~2% of spawned jobs.
            dist.destroy_process_group = os.abort
        return dist.get_rank() * 10

    with pytest.warns(TeardownWarning, match="rank 1 died during teardown after returning"):
        out = run(body, 2, "gloo", timeout=60)
    assert out == [0, 10]
    assert [o.rank for o in out.teardown_failures] == [1]
    assert "SIGABRT" in (out.teardown_failures[0].teardown or "")
    _gone(out.outcomes)


def test_worker_with_leaked_state_is_recycled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each leaky run's worker is replaced and its clean peer kept, read off the pool at once
    (which idle workers the next run gets depends on what earlier tests left in the pool)."""
    from meshsim.harness import pool

    monkeypatch.setattr(pool, "POOL_SIZE", 32)  # no clean worker is trimmed as a surplus

    def leak_thread() -> int:
        import threading

        import torch.distributed as dist

        if dist.get_rank() == 0:
            threading.Thread(target=__import__("time").sleep, args=(30,), daemon=True).start()
        return os.getpid()

    def leak_env() -> int:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.environ["MESHSIM_TEST_LEAK"] = "1"
        return os.getpid()

    def pid() -> int:
        return os.getpid()

    for leaky, bad in ((leak_thread, 0), (leak_env, 1), (leak_patch, 0)):
        pids = run(leaky, 2, "gloo", timeout=60)
        good = pids[1 - bad]
        assert pids[bad] not in pool_pids() and not process_alive(pids[bad]), leaky  # recycled
        assert good in pool_pids() and process_alive(good), leaky  # its clean peer is kept
        assert pids[bad] not in run(pid, 2, "gloo", timeout=120)
    assert "MESHSIM_TEST_LEAK" not in os.environ


def leak_patch() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce = lambda *args, **kwargs: None  # a monkeypatch nobody undoes
    return os.getpid()


def test_env_of_the_caller_reaches_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSIM_TEST_VALUE", "42")
    out = run(lambda: (os.environ.get("MESHSIM_TEST_VALUE"), os.environ["RANK"]), 2, "gloo")
    assert out == [("42", "0"), ("42", "1")]


def test_unpicklable_return_value_is_a_rank_failure() -> None:
    def body() -> object:
        return (x for x in range(3))

    with pytest.raises(RankFailure, match="returned a generator that dill cannot pickle"):
        run(body, 2, "gloo", timeout=60)


def test_rank_output_is_forwarded(capfd: pytest.CaptureFixture[str]) -> None:
    def body() -> None:
        import torch.distributed as dist

        print(f"hello from {dist.get_rank()}")

    run(body, 2, "gloo", timeout=60)
    err = capfd.readouterr().err
    assert "[rank 0] hello from 0" in err and "[rank 1] hello from 1" in err


def test_nccl_without_gpus_raises_not_enough_gpus() -> None:
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found >= 2:
        pytest.skip("this machine has 2 GPUs")
    with pytest.raises(NotEnoughGPUs, match=rf"world_size=2 needs 2 GPUs .* has {found};"):
        run(lambda: 0, 2, "nccl")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def _what_cuda_a_rank_sees() -> tuple:
    import torch

    return os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.is_available(), torch.cuda.device_count()


def test_gloo_ranks_see_no_gpu_whatever_the_caller_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gloo tier stands in for CPU machines: a rank that saw the caller's GPU would be put
    on cuda:LOCAL_RANK by frameworks (transformers' TP init did so on a 1-GPU machine, and ranks
    1-3 died: invalid device ordinal), and torch gives a whole-world mesh dim a group of its own
    where CUDA is available and the default group is gloo."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run(_what_cuda_a_rank_sees, 2, "gloo", timeout=120) == [("", False, 0)] * 2


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 GPUs (real NCCL, nothing mocked)")
def test_nccl_all_reduce_on_real_gpus() -> None:  # pragma: no cover - no GPU in CI
    def body() -> tuple:
        import torch
        import torch.distributed as dist

        t = torch.ones(1, device=context().device)
        dist.all_reduce(t)
        return context().device, t.item()

    assert run(body, 2, "nccl", timeout=120) == [("cuda:0", 2.0), ("cuda:1", 2.0)]


@pytest.mark.skipif(_cuda_devices() < 1, reason="needs a GPU (real NCCL, nothing mocked)")
def test_nccl_on_one_gpu_runs_collectives_and_reports_a_failing_rank() -> None:  # pragma: no cover
    """What one GPU can prove of the nccl tier: a real NCCL world comes up on cuda:0, runs a
    collective, and a rank that raises is a RankFailure naming it (checked on an H100)."""

    def body() -> tuple:
        import torch
        import torch.distributed as dist

        t = torch.full((4,), 3.0, device=context().device)
        dist.all_reduce(t)
        return dist.get_backend(), context().device, t.tolist()

    assert run(body, 1, "nccl", timeout=120) == [("nccl", "cuda:0", [3.0] * 4)]
    # The pool keeps gloo workers (no GPU) and nccl workers (the caller's GPUs) apart.
    assert run(_what_cuda_a_rank_sees, 2, "gloo", timeout=120) == [("", False, 0)] * 2
    assert run(body, 1, "nccl", timeout=120) == [("nccl", "cuda:0", [3.0] * 4)]

    def fails() -> None:
        raise ValueError("rank says no")

    with pytest.raises(RankFailure, match="rank 0: ValueError: rank says no"):
        run(fails, 1, "nccl", timeout=120)


def test_shutdown_leaves_nothing_behind() -> None:
    run(lambda: 0, 2, "gloo", timeout=120)
    workers = pool_pids()
    assert workers
    shutdown()
    assert pool_pids() == []
    assert not any(process_alive(p) for p in workers)
    assert not (child_pids() & set(workers))
    assert rendezvous.leftover_dirs() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(lambda: 1, 2, "gloo", timeout=120) == [1, 1]  # a fresh pool starts
