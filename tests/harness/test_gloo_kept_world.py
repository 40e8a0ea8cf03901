"""The gloo tier keeps a warm worker's world process group between jobs, and only when safe.

Each test proves one side of the rule: a kept world is reused (its sequence number carries on
from the previous job instead of starting at 0), and anything a job could leave behind in it
(groups, the group counter, an unmatched send, a destroyed world, a failure) either is reset
or makes every rank drop the world, so the next job sees what a fresh world shows.
"""

from __future__ import annotations

import os

import pytest

from meshsim.errors import CollectiveDivergence, RankFailure
from meshsim.harness import run
from meshsim.harness.pool import pool_pids


def world_age() -> tuple[int, int]:
    """(pid, collectives the world group ran before this job); then one more collective."""
    import torch
    import torch.distributed as dist

    seq = dist.group.WORLD._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1))
    return os.getpid(), seq


def groups_seen() -> tuple:
    """What a fresh world shows: only the world registered, the next group is named "1"."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    age = world_age()
    registered = len(c10d._world.pg_map)
    sub = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    return registered, c10d._get_process_group_name(sub), float(t[0]), age


def test_world_is_kept_between_jobs_of_the_same_world() -> None:
    first = run(groups_seen, 2, "gloo", timeout=60)
    second = run(groups_seen, 2, "gloo", timeout=60)
    assert [v[:3] for v in first + second] == [(1, "1", 2.0)] * 4  # no group leaked
    assert [v[3][0] for v in second] == [v[3][0] for v in first]  # same processes
    assert all(v[3][1] > 0 for v in second)  # the world group carried on: it was kept


def groups_in_a_cycle(count: int) -> tuple[int, int]:
    """Groups a framework holds in a reference cycle (megatron-core does): garbage after the
    job, but their gloo threads live until a collection finds them."""
    import torch.distributed as dist

    age = world_age()
    holder: list[object] = [dist.new_group([0, 1]) for _ in range(count)]
    holder.append(holder)
    return age


def native_threads() -> tuple[tuple[int, int], int]:
    return world_age(), len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_groups_kept_alive_by_a_cycle_do_not_pile_up_threads() -> None:
    """A kept world ran hundreds of megatron builds at world 16 and gathered thousands of gloo
    threads (one sweep slowed from 3 s to 30 s a layout). Past ``_SPARE_THREADS`` left over,
    the worker collects them."""
    from meshsim.harness.worker import _SPARE_THREADS

    # One timeout for all three runs: it is part of the kept world's key, so each run gets
    # the world the previous one kept (a different key would hand out other workers).
    before = run(native_threads, 2, "gloo", timeout=120)
    middle = run(groups_in_a_cycle, 2, "gloo", timeout=120, args=(_SPARE_THREADS,))
    after = run(native_threads, 2, "gloo", timeout=120)
    assert [m[0] for m in middle] == [b[0][0] for b in before]  # the same processes ...
    assert all(m[1] > b[0][1] for m, b in zip(middle, before))  # ... on the same kept world
    assert [a[0][0] for a in after] == [b[0][0] for b in before]
    assert all(a[0][1] > m[1] for a, m in zip(after, middle))
    # The >= 256 threads each left behind were freed (without the collection, each worker
    # would have that many more); the collection may also free what earlier jobs left.
    assert all(a[1] <= b[1] for a, b in zip(after, before)), (before, after)


def collect() -> tuple[int, int]:
    """A later job's collection: it frees the cycle, and with it the last hold on the groups
    but the worker's (the groups themselves are freed between jobs, off the main thread)."""
    import gc

    gc.collect()
    return world_age()


def threads_once_at_most(limits: list[int]) -> tuple[tuple[int, int], int]:
    """This worker's thread count, once it is at most its rank's limit (given a minute to get
    there: the groups are freed by threads the previous job's end started)."""
    import time

    import torch.distributed as dist

    limit = limits[dist.get_rank()]  # rank 0 also runs the world store's server thread
    deadline = time.monotonic() + 60
    while len(os.listdir("/proc/self/task")) > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return native_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_groups_in_a_cycle_are_freed_between_jobs_below_the_spare() -> None:
    """A handful of groups in a cycle (far fewer threads than ``_SPARE_THREADS``): the worker
    frees them itself once a collection broke the cycle, without retiring. (The old workers
    passed this too, freeing them inside the collecting job; the graveyard's own tests show
    where they are freed now.)"""
    before = run(native_threads, 2, "gloo", timeout=120)
    made = run(groups_in_a_cycle, 2, "gloo", timeout=120, args=(4,))
    collected = run(collect, 2, "gloo", timeout=120)
    after = run(threads_once_at_most, 2, "gloo", timeout=120, args=([b[1] for b in before],))
    pids = [b[0][0] for b in before]
    assert [m[0] for m in made] == pids and [c[0] for c in collected] == pids
    assert [a[0][0] for a in after] == pids  # the same workers, on the same kept world
    assert all(a[1] <= b[1] for a, b in zip(after, before)), (before, after)


def groups_held_by_a_module(count: int) -> tuple[int, int]:
    """Groups a framework's module globals still hold after the job (megatron-core's
    parallel_state does, until its next initialize): no collection can free their threads."""
    import json

    import torch.distributed as dist

    age = world_age()
    json._meshsim_test_held_groups = [dist.new_group([0, 1]) for _ in range(count)]  # type: ignore[attr-defined]
    return age


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_threads_no_collection_frees_retire_the_worker() -> None:
    """Each idle gloo loop thread wakes every 10 ms: a worker holding hundreds of them loads
    the machine even between jobs. Past ``_SPARE_THREADS`` that a collection cannot free, the
    worker is replaced by a fresh one, which starts without them."""
    from meshsim.harness.worker import _SPARE_THREADS

    before = run(native_threads, 2, "gloo", timeout=120)
    held = run(groups_held_by_a_module, 2, "gloo", timeout=120, args=(_SPARE_THREADS,))
    after = run(native_threads, 2, "gloo", timeout=120)
    assert [h[0] for h in held] == [b[0][0] for b in before]  # the job ran on the same workers
    assert not {a[0][0] for a in after} & {b[0][0] for b in before}  # then they were replaced
    assert all(a[1] <= b[1] + _SPARE_THREADS for a, b in zip(after, before)), (before, after)


def unmatched_send() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    age = world_age()
    if dist.get_rank() == 0:
        dist.isend(torch.full((1,), 99.0), 1)  # never received
    return age


def recv_from_zero() -> tuple[float, tuple[int, int]]:
    import torch
    import torch.distributed as dist

    age = world_age()
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.send(torch.full((1,), 7.0), 1)
    else:
        dist.recv(t, 0)
    return float(t[0]), age


def test_point_to_point_traffic_drops_the_world() -> None:
    run(world_age, 2, "gloo", timeout=60)
    with pytest.raises(CollectiveDivergence, match="never received"):  # gloo let it vanish
        run(unmatched_send, 2, "gloo", timeout=60)
    warm = set(pool_pids())
    after = run(recv_from_zero, 2, "gloo", timeout=60)
    assert after[1][0] == 7.0  # not the 99.0 the previous job left unreceived
    # Warm workers (which idle ones are handed out is the pool's choice), no new start.
    assert {a[1][0] for a in after} <= warm
    assert [a[1][1] for a in after] == [0, 0]  # but a fresh world group


def destroy_and_reinit() -> int:
    import torch
    import torch.distributed as dist

    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(os.environ["MESHSIM_TEST_DIR"], "store"), 2)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t[0])


def test_user_code_may_destroy_and_reinit_the_world(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHSIM_TEST_DIR", str(tmp_path))
    run(world_age, 2, "gloo", timeout=60)
    assert run(destroy_and_reinit, 2, "gloo", timeout=60) == [2, 2]
    after = run(groups_seen, 2, "gloo", timeout=60)
    assert [v[:3] for v in after] == [(1, "1", 2.0)] * 2
    assert [v[3][1] for v in after] == [0, 0]  # the user's world was not kept


def fail_on_one() -> int:
    import torch.distributed as dist

    world_age()
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return 0


def test_a_failed_job_drops_the_world() -> None:
    run(world_age, 2, "gloo", timeout=60)
    with pytest.raises(RankFailure):
        run(fail_on_one, 2, "gloo", timeout=60)
    warm = set(pool_pids())
    after = run(world_age, 2, "gloo", timeout=60)
    assert {p for p, _ in after} <= warm  # the workers stayed warm: none was started
    assert [s for _, s in after] == [0, 0]  # but the world group is new


def test_another_world_size_in_between() -> None:
    run(groups_seen, 2, "gloo", timeout=60)
    three = run(groups_seen, 3, "gloo", timeout=60)
    again = run(groups_seen, 2, "gloo", timeout=60)
    assert [v[:3] for v in three] == [(1, "1", 3.0)] * 3
    assert [v[:3] for v in again] == [(1, "1", 2.0)] * 2


def builds_an_optimizer() -> tuple[int, int]:
    """A training step's first optimizer: torch imports ``torch._dynamo``, which sets
    ``TORCHINDUCTOR_CACHE_DIR`` in the environment (torch's doing, not the body's)."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    return world_age()


def test_an_environment_variable_torch_sets_on_import_keeps_the_worker() -> None:
    first = run(builds_an_optimizer, 2, "gloo", timeout=60)
    second = run(world_age, 2, "gloo", timeout=60)
    assert [pid for pid, _ in second] == [pid for pid, _ in first]  # the worker stayed
    assert all(seq > 0 for _, seq in second)  # and so did its world


def changes_the_environment() -> tuple[int, int]:
    os.environ["MESHSIM_TEST_LEFT_BEHIND"] = "1"
    return world_age()


def test_an_environment_variable_the_body_sets_still_retires_the_worker() -> None:
    first = run(changes_the_environment, 2, "gloo", timeout=60)
    second = run(world_age, 2, "gloo", timeout=60)
    assert not {pid for pid, _ in second} & {pid for pid, _ in first}
    assert "MESHSIM_TEST_LEFT_BEHIND" not in os.environ


def world_store() -> tuple[str, int | None, list[str]]:
    """The world's store under the job's prefixes, its port, and where that port listens."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store = c10d._world.pg_map[c10d._get_default_group()][1]
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    port = getattr(store, "port", None)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if port is None or not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    listening.append(address)
    return type(store).__name__, port, listening


def test_the_world_store_is_served_on_loopback_only() -> None:
    """A TCP store (a FileStore polls every 10 ms while waiting), served by rank 0 on
    127.0.0.1 only: the machine's rule for any server meshsim starts."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs /proc/net/tcp (Linux) to see where the store listens")
    seen = run(world_store, 2, "gloo")
    kind, port, listening = seen[0]
    assert kind == "TCPStore" and port and seen[1][:2] == (kind, port)
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing else (no ::)


def test_a_file_store_world_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MESHSIM_WORLD_STORE=file`` (and rank 0 failing to serve a TCP store) fall back to a
    FileStore in the world's directory; the run behaves the same."""
    monkeypatch.setenv("MESHSIM_WORLD_STORE", "file")
    assert [s[0] for s in run(world_store, 2, "gloo")] == ["FileStore", "FileStore"]
    assert [r[:3] for r in run(groups_seen, 2, "gloo")] == [(1, "1", 2.0)] * 2
