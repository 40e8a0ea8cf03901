"""The code inside a pool worker process: boot once with torch imported, then run ranks.

Protocol (pickled tuples over a socketpair): worker -> ``("ready", pid)``; parent ->
``("job", spec)``; worker -> ``("result", outcome)`` as soon as the body returned, then
``("done", problems)`` after teardown. Every call the body makes is appended to the job's
``calls-<rank>`` file before it is issued (``recorder.StreamSink``), for the parent to read.
An empty ``problems`` list means the worker is clean and may take the next job; otherwise it
exits and the parent replaces it. Parent -> ``("exit",)`` ends the worker.

Teardown is robust by construction: every rank signals "finished" through the job's file
store and waits for the others before destroying its process group, so no rank tears down
its gloo connections while a peer is still inside a collective with it.

Kept worlds: setting up gloo's full mesh of TCP pairs is most of a small job's cost, so a gloo
worker keeps its world process group for the next job of the same world (same workers in the
same rank order, same timeout and environment; the parent decides, see ``Pool.acquire``).
It does so only when every rank agrees through the store that the job left the world as a
fresh one would be: every body returned, nobody replaced torch functions or destroyed the
world, no point-to-point call was made (an unmatched send could be received by the next job)
and every rank's world sequence number is equal (no rank ran an extra collective). Every
other group is destroyed and the group counter reset, and each job's ``new_group`` calls get
their own key prefix in the world's store, so group names and store traffic are those of a
fresh world. In every other case the world is destroyed, as before.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from meshsim import torch_private
from meshsim.harness import isolation, pickling, recorder, rendezvous, rng
from meshsim.harness.context import RankContext, rank_context
from meshsim.harness.graveyard import Graveyard
from meshsim.harness.outcome import exception_fields

#: Seconds between checks that the parent is still alive.
ORPHAN_POLL_S = 0.5
#: How long past the run's deadline a finished rank waits for its peers in teardown.
TEARDOWN_MARGIN_S = 30.0
#: How long rank 0 waits, at most, for its peers to read the finish marks from its store.
READ_WAIT_S = 10.0


def _watch_parent(parent: int) -> None:
    """Exit when the parent dies, even while a body hangs (no orphans after a hard kill)."""
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent:
            os._exit(70)


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


_WATCHED_MODULES = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.device_mesh",
    torch_private.FUNCOL,
)


def _torch_bindings() -> dict[tuple[str, str], int]:
    """Identity of every function of the torch.distributed modules a body might monkeypatch."""
    found: dict[tuple[str, str], int] = {}
    for name in _WATCHED_MODULES:
        module = sys.modules.get(name)
        for attr, value in vars(module).items() if module is not None else ():
            if callable(value) and not isinstance(value, type):
                found[(name, attr)] = id(value)
    return found


class _JobSink(recorder.StreamSink):
    """The job's ``StreamSink``, which also counts point-to-point calls.

    The parent reads the stream as the rank runs (``meshsim.harness.gloo``); a point-to-point
    call forbids keeping the world.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.p2p = 0

    def enter(self, call: recorder.Call) -> None:
        if call.kind == "p2p":
            self.p2p += 1
        super().enter(call)


class _KeptWorld:
    """A world process group kept between jobs, with the store it was set up with."""

    def __init__(self, world_id: int, store: Any) -> None:
        self.id = world_id
        self.store = store
        self.pg = torch_private.default_group()
        self.entry = torch_private.world().pg_map[self.pg]
        self.threads = _native_threads()  # with the world up: what a job must leave behind

    def begin_job(self, job_store: Any) -> None:
        """Route this job's ``new_group`` store traffic to the job's own key prefix."""
        import torch.distributed as dist

        backend, default_store = self.entry
        torch_private.world().pg_map[self.pg] = (backend, dist.PrefixStore("groups/", job_store))
        del default_store

    def end_job(self, graveyard: Graveyard) -> None:
        """Destroy every group but the world and reset the group counter, as a fresh world.
        The gloo groups go to ``graveyard``, to be freed between jobs."""
        world = torch_private.world()
        for pg in list(world.pg_map):
            if pg is not self.pg:
                _destroy(graveyard, pg)
        world.pg_map[self.pg] = self.entry
        world.group_count = 1

    def current(self) -> bool:
        """The world is still this process's default group (the body did not replace it)."""
        import torch.distributed as dist

        return dist.is_initialized() and torch_private.default_group() is self.pg


def _destroy(graveyard: Graveyard, group: Any = None) -> None:
    """``destroy_process_group(group)`` (None: the world, and with it every group), the gloo
    groups going to ``graveyard`` to be freed between jobs (an nccl group is freed as usual)."""
    import torch.distributed as dist

    pg_map = torch_private.world().pg_map
    doomed = list(pg_map) if group is None else [group]
    gloo = [pg for pg in doomed if dist.get_backend(pg) == "gloo"]
    dist.destroy_process_group(group)
    for pg in gloo:
        graveyard.bury(pg)


#: Threads that destroyed groups may keep alive before a full collection frees them. Each job
#: ends with a young-generation one (see ``Worker.run_job``); what that misses (cycles promoted
#: to the old generation) waits for this, since a full collection after every job made a
#: world-8 test cost 633 ms instead of ~110 ms. Threads no collection can free (groups a
#: framework's module globals still hold) retire the worker: the pool forks a fresh one. They
#: are not harmless while idle: each gloo TCP loop thread wakes every 10 ms (its epoll_wait
#: timeout), and workers that had kept ~500 of them each (the limit used to be raised to
#: whatever a collection left) loaded a 2-core machine to a load average in the hundreds,
#: mostly in the kernel, while the test suite ran.
_SPARE_THREADS = 96
#: Environment variables torch itself sets once per process, not the body: ``torch._dynamo``
#: (imported by the first optimizer a process builds) sets the inductor cache dir, and the
#: first CPU ``torch.compile`` the address its C++ reads back with ``getenv``. Reporting them
#: retired every worker whose job built an optimizer, so the next job paid the ~9 s import
#: again on a loaded 2-core machine.
_SET_BY_TORCH_IMPORTS = frozenset(
    {"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
)


def _release_groups() -> None:
    """Free the destroyed groups that something still holds in a reference cycle.

    ``destroy_process_group`` only forgets a group; its gloo threads and sockets go with the
    last reference, and frameworks keep groups in cycles (so does a sliced ``DeviceMesh``):
    megatron-core 0.16 left ~50 threads per job at world 4, and a few hundred world-16 jobs on
    one kept world piled up thousands of threads and starved the machine. It runs once more
    than ``_SPARE_THREADS`` outlived their jobs. A full collection with torch and a framework
    imported costs a few hundred ms, so what survives it is frozen: the next one walks only
    what later jobs allocated, and what is frozen lives as long as the worker anyway.
    """
    gc.collect()
    gc.freeze()


def _threads_outlived(baseline: int | None, graveyard: Graveyard) -> int:
    """Native threads above ``baseline`` + the spare that a collection cannot free (0 when
    within bounds, or where threads cannot be counted)."""
    if baseline is None or not _too_many_threads(baseline):
        return 0
    graveyard.free()  # groups only the graveyard holds: their threads are on their way out
    graveyard.wait()
    if _too_many_threads(baseline):
        _release_groups()
        graveyard.free()  # what only the collected cycles held
        graveyard.wait()
    now = _native_threads()
    return now - baseline if now is not None and now > baseline + _SPARE_THREADS else 0


def _too_many_threads(baseline: int | None) -> bool:
    threads = _native_threads()
    return threads is None or baseline is None or threads > baseline + _SPARE_THREADS


def _native_threads() -> int | None:
    """This process's OS threads (gloo's are invisible to ``threading``); None off Linux."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


class Worker:
    def __init__(self, fd: int) -> None:
        from multiprocess.connection import Connection

        self.conn = Connection(fd)
        self.devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the worker
        self.baseline_threads: set[int | None] = set()
        self.baseline_torch: dict[tuple[str, str], int] = {}
        self.world: _KeptWorld | None = None
        self.job_base: Any = None
        self.graveyard = Graveyard()
        #: An nccl worker sees the caller's GPUs; a gloo worker none (see ``meshsim.harness.pool``).
        self.gpus = os.environ.get("MESHSIM_WORKER_GPUS") == "1"  # pool.GPUS_ENV (no import circle)
        if not self.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here starts the CUDA driver

    def send(self, *msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg))

    def boot(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
        faulthandler.enable(file=sys.stderr, all_threads=True)  # crash stacks into the log
        faulthandler.register(signal.SIGUSR1, file=self.devnull, all_threads=True)
        threading.Thread(
            target=_watch_parent, args=(os.getppid(),), name="meshsim-orphan-watch", daemon=True
        ).start()
        import dill  # noqa: F401
        import torch

        torch_private.preload()
        torch.set_num_threads(1)  # N ranks share the machine's cores, as under torchrun
        recorder.install()
        self.baseline_threads = {t.ident for t in threading.enumerate()}
        self.boot_native_threads = _native_threads()
        self.baseline_torch = _torch_bindings()
        self.send("ready", os.getpid())

    def serve(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return
            if msg[0] != "job":
                return
            if not self.run_job(msg[1]):
                return

    # ------------------------------------------------------------------ one rank

    def run_job(self, spec: dict[str, Any]) -> bool:
        rank, world, job_dir = spec["rank"], spec["world_size"], spec["dir"]
        saved_env, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
        body_env = dict(spec["env"])
        body_env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
        )
        if not self.gpus:
            body_env["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.clear()
        os.environ.update(body_env)
        sys.path[:] = spec["sys_path"]
        os.chdir(spec["cwd"])
        rng.start_fresh()  # a reused worker's generators as a new process's
        stack_file = open(os.path.join(job_dir, f"stack-{rank}"), "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        calls_fd = os.open(
            os.path.join(job_dir, f"calls-{rank}"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
        )
        sink = _JobSink(calls_fd)
        recorder.set_sink(sink, process_wide=True)
        deadline = time.monotonic() + spec["timeout"]
        store = None
        kept = False
        try:
            store = self.job_store(spec)
            outcome = self.run_body(spec, store, sink)
            outcome["recording_lost"] = sink.broken
            self.send("result", outcome)
            problems, kept = self.teardown(store, spec, outcome, sink, deadline)
        finally:
            recorder.set_sink(None, process_wide=True)
            faulthandler.register(signal.SIGUSR1, file=self.devnull, all_threads=True)
            stack_file.close()
            os.close(calls_fd)
            del store
        changed = sorted(
            k for k in set(os.environ) | set(body_env) if os.environ.get(k) != body_env.get(k)
        )
        for key in set(changed) & _SET_BY_TORCH_IMPORTS:
            # torch set it while importing a module (once per process): keep it, as a fresh
            # process would after that import, and do not retire a clean worker for it.
            saved_env[key] = os.environ[key] if key in os.environ else saved_env.get(key, "")
            changed.remove(key)
        if changed:
            problems.append(f"the body changed environment variables {changed[:8]}")
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
        # A young-generation collection breaks the cycles this job left (a sliced DeviceMesh,
        # a framework's state) unless they grew old during the job, so the groups they held
        # are freed between jobs, off the main thread, not by a collection inside a later
        # job while its peers wait (world-8 tests: median 96 ms and outliers to 0.8 s without
        # it, 67 ms and none with it). A full collection would walk torch's whole heap: ~0.4
        # s a job. What grew old goes when a later collection frees it.
        gc.collect(1)
        self.graveyard.free()
        problems += self.leftovers()
        if problems and self.world is not None:
            self.drop_world()
            kept = False
        self.send("done", problems, kept)
        return not problems

    def job_store(self, spec: dict[str, Any]) -> Any:
        """This job's store: a fresh key prefix in the (possibly kept) world's ``FileStore``."""
        import torch.distributed as dist

        if self.world is not None and self.world.id != spec["world_id"]:
            self.drop_world()
        if self.world is None:
            # A new world counts its threads as its baseline: none of an old group's first.
            self.graveyard.free()
            self.graveyard.wait()
            base = rendezvous.world_store(
                spec["world_dir"], spec["rank"], spec["world_size"], spec["timeout"] + 30
            )
        else:
            base = self.world.store
        self.job_base = base
        return dist.PrefixStore(os.path.basename(spec["dir"]) + "/", base)

    def drop_world(self) -> None:
        """Destroy the kept world (its peers drop theirs when they next get a job)."""
        world, self.world = self.world, None
        if world is not None and world.current():
            _destroy(self.graveyard)

    def run_body(self, spec: dict[str, Any], store: Any, sink: recorder.StreamSink) -> dict:
        import torch
        import torch.distributed as dist

        rank, world, backend = spec["rank"], spec["world_size"], spec["backend"]
        device = "cpu"
        try:
            try:
                fn, args, kwargs = pickling.loads(spec["payload"])
            except Exception as exc:
                fields = exception_fields(exc)
                fields["error_message"] = (
                    f"could not load the body in the worker: {exc}. The worker imports the "
                    "body's module by name with the caller's sys.path and working directory; "
                    "make that module importable or define the body inside the test."
                )
                return {"status": "error", **fields}
            extra: dict[str, Any] = {}
            if backend == "nccl":
                torch.cuda.set_device(rank)
                device = f"cuda:{rank}"
                extra["device_id"] = torch.device(device)
            if self.world is None:
                dist.init_process_group(
                    backend,
                    store=self.job_base,
                    rank=rank,
                    world_size=world,
                    timeout=timedelta(seconds=spec["timeout"] + 30),
                    **extra,
                )
                self.world = _KeptWorld(spec["world_id"], self.job_base)
            self.world.begin_job(store)
            ctx = RankContext(rank=rank, world_size=world, backend=backend, device=device)
            with rank_context(ctx, process_wide=True):
                value = fn(*args, **kwargs)
        except BaseException as exc:
            return {
                "status": "error",
                "collective": sink.raised_where(world),
                **exception_fields(exc),
            }
        try:
            data = pickling.dumps(value)
        except Exception as exc:
            fields = exception_fields(exc)
            fields["error_message"] = (
                f"rank {rank} returned a {type(value).__name__} that dill cannot pickle "
                f"({exc}); return plain data (numbers, lists, tensors) instead"
            )
            return {"status": "error", **fields}
        return {"status": "ok", "value": data}

    def teardown(
        self, store: Any, spec: dict[str, Any], outcome: dict, sink: _JobSink, deadline: float
    ) -> tuple[list[str], bool]:
        """Wait (through the store) until every rank finished, then keep or destroy the world.

        Returns the problems found and whether the world process group was kept.
        """
        import torch.distributed as dist

        rank, world = spec["rank"], spec["world_size"]
        problems: list[str] = []
        candidate = (
            spec.get("keep_world", False)
            and outcome["status"] == "ok"
            and sink.p2p == 0
            and self.world is not None
            and self.world.current()
            and _torch_bindings() == self.baseline_torch
        )
        mark = "0"
        if candidate:
            mark = f"1:{torch_private.sequence_number(self.world.pg)}"  # type: ignore[union-attr]
        keys = [f"meshsim/finished/{r}" for r in range(world)]
        marks: list[str] = []

        def left() -> timedelta:
            # Past the run's deadline: the parent stops a late job, never the ranks' own
            # teardown (a rank giving up would break its peers' collectives mid-report).
            return timedelta(seconds=max(1.0, deadline + TEARDOWN_MARGIN_S - time.monotonic()))

        try:
            store.set(keys[rank], mark)
            store.wait(keys, left())
            try:
                marks = [store.get(k).decode() for k in keys]
            finally:
                store.set(f"meshsim/read/{rank}", "1")
            # Rank 0 serves the world's store and may leave the pool right after this job (a
            # problem found below retires it): it waits until every rank has read the marks,
            # or a slower peer's reads would find the store gone.
            if rank == 0:
                reads = [f"meshsim/read/{r}" for r in range(world)]
                store.wait(reads, min(left(), timedelta(seconds=READ_WAIT_S)))
        except Exception as exc:
            problems.append(f"teardown: the other ranks did not finish ({exc})")
        keep = bool(marks) and marks[0].startswith("1:") and len(set(marks)) == 1
        try:
            if keep:
                self.world.end_job(self.graveyard)  # type: ignore[union-attr]
            else:
                self.world = None
                if dist.is_initialized():
                    _destroy(self.graveyard)
        except Exception as exc:
            problems.append(f"teardown: destroy_process_group failed ({exc})")
            keep = False
        isolation.reset_rank_state(keep_default=keep)
        return problems, keep

    def leftovers(self) -> list[str]:
        kept = self.world.pg if self.world is not None else None
        problems = isolation.leftovers(kept=kept)
        baseline = self.world.threads if self.world is not None else self.boot_native_threads
        outlived = _threads_outlived(baseline, self.graveyard)
        if outlived:
            problems.append(
                f"{outlived} native threads outlived their jobs (process groups something "
                "still holds): a fresh worker replaces this one"
            )
        extra = [t for t in threading.enumerate() if t.ident not in self.baseline_threads]
        for t in extra:
            t.join(0.2)
        names = [t.name for t in extra if t.is_alive()]
        if names:
            problems.append(f"the body left threads running: {names[:8]}")
        now = _torch_bindings()
        replaced = sorted(
            f"{m}.{a}" for (m, a), v in self.baseline_torch.items() if now.get((m, a)) != v
        )
        if replaced:
            problems.append(f"the body replaced torch functions: {replaced[:8]}")
        children = _children()
        if children:
            problems.append(f"the body left child processes: {children[:8]}")
        return problems


def main(fd: int) -> None:
    """Entry point of ``python -c 'from meshsim.harness.worker import main; main(fd)'``."""
    code = 0
    try:
        worker = Worker(fd)
        worker.boot()
        worker.serve()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: torch's C++ threads make it fragile
