"""Real accelerate adapter: accelerate's own ``ParallelismConfig``, mesh, validation and loader.

``build(world_size, config)`` does on this rank what ``Accelerator.__init__`` and ``prepare`` do
with a ``ParallelismConfig``, calling accelerate's code wherever it runs without a full
``Accelerator``:

* ``ParallelismConfig(**sizes)`` (its ``__post_init__`` validation; accelerate 1.10 has no
  ``sp_size`` and raises ``TypeError`` for it) and ``get_device_mesh(device)`` (which calls
  ``build_device_mesh``), on the harness's process group;
* ``_validate_accelerator`` with a stand-in holding the attributes it reads
  (``multi_device``, ``num_processes``, ``is_fsdp2``, ``distributed_type``,
  ``is_main_process``), set for the GPU job the config names (``distributed_type``);
* ``prepare_data_loader`` on a ``DataLoader`` over ``range(64)`` with the mesh
  ``Accelerator._prepare_device_mesh`` would pass. ``PartialState``'s shared state is filled from
  ``torch.distributed`` (rank, world, distributed type) for the call and restored after, since
  its own discovery reads launcher variables. The batches each rank's sampler yields are
  gathered: ranks loading the same batches are ``dataloader_batch_peers``, and
  ``dataloader_replica`` takes one rank per distinct batch stream (the same place among its
  peers), so the loader's groups come from data, not from accelerate's arithmetic.

Two steps are replayed, not called: ``AcceleratorState``'s "``cp_size > 1`` needs an
``fsdp_plugin``" check (it runs inside the state's launcher-driven init) and
``_prepare_deepspeed``'s AutoTP mesh ``init_device_mesh(device, (autotp_size,), ("tp",))``
(that method needs DeepSpeed and a model). ``fsdp_mesh`` is ``mesh[fsdp_dim_names]`` read with
accelerate's own ``fsdp_dim_names`` (``fsdp2_prepare_model``'s expression), ``ddp`` the world group
``DistributedDataParallel`` uses. Tested with accelerate 1.15.0 and 1.10.0.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshsim.builders._common import Entry, FrameworkRejection, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation
from meshsim.errors import UsageError

SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
NAMES = ("dp_replicate", "dp_shard", "cp", "sp", "tp", "dp", "dp_shard_cp", "dp_cp")
SAMPLES = 64


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run accelerate's mesh and loader code for ``config`` and observe every kind.

    Example (world 8): ``{"tp_size": 2, "dp_shard_size": 4}``: accelerate's (dp_shard, tp) =
    (4, 2) mesh, ``tp`` ``(0, 1)`` on rank 0; ranks 0 and 1 load the same batches.
    """
    kind, pc, root = device_mesh(world_size, config)
    entries: dict[str, Entry] = {name: _ask(root, name) for name in NAMES}
    if kind == "FSDP":
        entries["fsdp_mesh"] = (
            dist.group.WORLD if root is None else _ask(root, tuple(pc.fsdp_dim_names))
        )
    elif kind == "MULTI_GPU" and not pc.tp_enabled:
        entries["ddp"] = dist.group.WORLD
    loader_mesh = root
    autotp = int(config.get("autotp_size") or 0)
    if kind == "DEEPSPEED" and autotp > 1:
        loader_mesh = _autotp_mesh(world_size, autotp, _shims.device_type())
        entries["ds:tp"] = loader_mesh if dist.get_rank() < autotp else None
    sp = int(config.get("sp_size") or 1)
    if kind == "DEEPSPEED" and sp > 1 and installed_version() == "1.15":
        entries.update(_ulysses_groups(sp))
    dispatch = bool(config.get("dispatch_batches"))
    with _shims.unchanged_environ(), loader_state(world_size, kind):
        prepared = prepare_loader(world_size, loader_mesh, dispatch=dispatch)
        if dispatch:  # the dispatcher broadcasts from rank 0: every rank iterates in step
            mine = tuple(int(i) for batch in prepared for i in batch.tolist())
        else:
            mine = tuple(int(i) for batch in prepared.batch_sampler for i in batch)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    entries.update(_loader_groups([tuple(g) for g in gathered]))
    return collect(entries)


def device_mesh(world_size: int, config: Mapping[str, Any]) -> tuple[str, Any, Any]:
    """``Accelerator.__init__``'s part: (distributed type, the ``ParallelismConfig``, the mesh
    ``get_device_mesh`` built, None when it builds none), validated by ``_validate_accelerator``."""
    check_keys("accelerate", config)
    _check_version(config)
    pc_module, utils = _shims.load("accelerate.parallelism_config", "accelerate.utils")
    kind = _distributed_type(config)
    keys = (*SIZE_KEYS, "cp_backend", "sp_backend")
    sizes = {k: config[k] for k in keys if config.get(k) is not None}
    with _shims.unchanged_environ():
        with framework_refusals():
            pc = pc_module.ParallelismConfig(**sizes)
        if pc.cp_size > 1 and kind == "MULTI_GPU":  # AcceleratorState, replayed
            raise FrameworkRejection(
                "`cp_size > 1` specified in the `parallelism_config`, but no `fsdp_plugin` was "
                "provided",
                upstream="ValueError",
            )
        with framework_refusals():
            root = pc.get_device_mesh(_shims.device_type())
            pc._validate_accelerator(_stand_in(world_size, kind, utils.DistributedType))
    return kind, pc, root


def prepare_loader(world_size: int, loader_mesh: Any, *, dispatch: bool = False) -> Any:
    """accelerate's ``prepare_data_loader`` over ``range(64)``, one sample per batch, as
    ``Accelerator.prepare_data_loader`` calls it with ``loader_mesh`` (``dispatch``: its
    ``DataLoaderDispatcher``, which needs ``put_on_device``; the device is the CPU). Call it,
    and iterate what it returns, inside :func:`loader_state`."""
    from torch.utils.data import DataLoader

    (data_loader,) = _shims.load("accelerate.data_loader")
    with framework_refusals():
        return data_loader.prepare_data_loader(
            DataLoader(list(range(SAMPLES)), batch_size=1),
            None,
            num_processes=world_size,
            process_index=dist.get_rank(),
            put_on_device=dispatch,
            rng_types=[],
            dispatch_batches=dispatch,
            torch_device_mesh=loader_mesh,
        )


def installed_version() -> str:
    """The installed accelerate's ``major.minor`` (``"1.15"``), as the convention spells it."""
    from importlib.metadata import version

    return ".".join(version("accelerate").split(".")[:2])


def _check_version(config: Mapping[str, Any]) -> None:
    """The adapter runs the installed accelerate only; a config naming another release is
    modelled by the reference alone."""
    from meshsim.model.conventions.accelerate import version_of

    wanted, found = version_of(config), installed_version()
    if wanted != found:
        raise UsageError(
            f"the config models accelerate {wanted} but accelerate {found} is installed; the "
            f"real adapter runs the installed release only (set version={found!r}, or install "
            f"accelerate=={wanted}.0)"
        )


def _distributed_type(config: Mapping[str, Any]) -> str:
    """meshsim's default for ``distributed_type`` (see the convention's PARAMETERS)."""
    kind = config.get("distributed_type")
    if kind is not None:
        return str(kind)
    if (config.get("dp_shard_size") or 1) > 1 or (config.get("cp_size") or 1) > 1:
        return "FSDP"
    if (config.get("sp_size") or 1) > 1 or (config.get("autotp_size") or 0) > 1:
        return "DEEPSPEED"
    return "MULTI_GPU"


def _stand_in(world_size: int, kind: str, types_enum: Any) -> Any:
    """What ``_validate_accelerator`` reads off the Accelerator, for a GPU job of ``kind``."""
    return types.SimpleNamespace(
        multi_device=kind == "MULTI_GPU" and world_size > 1,
        num_processes=world_size,
        is_fsdp2=kind == "FSDP",
        distributed_type=types_enum[kind],
        is_main_process=dist.get_rank() == 0,
    )


def _ask(root: Any, name: str | tuple[str, ...]) -> Entry:
    """``mesh[name]`` as accelerate asks it (``torch_device_mesh`` may be None), or its error."""
    try:
        return root[name]  # type: ignore[no-any-return]
    except (KeyError, TypeError) as error:
        return error


def _autotp_mesh(world_size: int, autotp: int, device: str) -> Any:
    """``_prepare_deepspeed``'s mesh, with its size checks (torch raises beyond the world).

    A size not dividing the world is accelerate's to build, and fails later in DeepSpeed's
    engine, which this adapter does not run: its ``_init_tp_mesh_device`` raises IndexError on
    the ranks its TP mesh leaves out (tests/real/test_accelerate.py runs that function to show
    it). Stated here so the refusal carries DeepSpeed's type."""
    from torch.distributed.device_mesh import init_device_mesh

    with framework_refusals():
        built = init_device_mesh(device, (autotp,), mesh_dim_names=("tp",))
    if world_size % autotp:
        raise FrameworkRejection(
            f"autotp_size {autotp} does not divide the world {world_size}: DeepSpeed's "
            "_init_tp_mesh_device leaves ranks out of its TP mesh (IndexError there)",
            upstream="IndexError",
        )
    return built


def _ulysses_groups(sp: int) -> dict[str, Entry]:
    """DeepSpeed's ``parallel_state_sp.initialize_sequence_parallel(sp)``, which
    ``_prepare_deepspeed`` reaches through ``UlyssesSPAttentionHF.register_with_transformers``
    (that call also needs a transformers model; only its group construction runs here). Its
    refusals come out as the framework's. The module's groups are dropped afterwards."""
    (state,) = _shims.load("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    with _shims.deepspeed_comm():
        state._release_sequence_parallel_groups()
        try:
            with framework_refusals():
                state.initialize_sequence_parallel(sequence_parallel_size=sp)
            return {
                "ds:sp": state.get_sequence_parallel_group(),
                "ds:sp_dp": state.get_sequence_data_parallel_group(),
            }
        finally:
            state._release_sequence_parallel_groups()


@contextlib.contextmanager
def loader_state(world_size: int, kind: str) -> Iterator[None]:
    """``PartialState()`` answering with this rank and DistributedType ``kind`` (and a fresh
    ``GradientState``) while accelerate's loader code runs; both restored after."""
    from accelerate.state import GradientState, PartialState
    from accelerate.utils import DistributedType

    distributed_type = DistributedType[kind]
    saved = dict(PartialState._shared_state), dict(GradientState._shared_state)
    rank = dist.get_rank()
    PartialState._shared_state.clear()
    PartialState._shared_state.update(
        {
            "_cpu": True,
            "backend": str(dist.get_backend()),
            "device": torch.device("cpu"),
            "debug": False,
            "distributed_type": distributed_type,
            "num_processes": world_size,
            "process_index": rank,
            "local_process_index": rank,
            "fork_launched": False,
        }
    )
    try:
        yield
    finally:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(saved[0])
        GradientState._shared_state.clear()
        GradientState._shared_state.update(saved[1])


def _loader_groups(batches: list[tuple[int, ...]]) -> dict[str, Entry]:
    """This rank's peers (same batches) and replica group (one rank per distinct batch
    stream, at this rank's place among its peers, streams in order of their first sample)."""
    rank = dist.get_rank()
    streams = sorted(set(batches))
    peers = [tuple(r for r, b in enumerate(batches) if b == s) for s in streams]
    mine = next(p for p in peers if rank in p)
    place = mine.index(rank)
    replica = tuple(p[place] for p in peers if len(p) > place)
    return {"dataloader_replica": replica, "dataloader_batch_peers": mine}
