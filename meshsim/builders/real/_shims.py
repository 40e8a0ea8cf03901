"""Every CPU / warm-worker workaround the real-framework adapters need, each explained.

The adapters run a framework's own group-construction code inside a rank of meshsim's harness:
a CPU machine, a gloo (or fake) default process group that already exists, and a worker process
that is reused for many builds. Each framework assumes otherwise somewhere; each shim below
says which version needs it, why, and what it touches. Nothing here changes which ranks a
framework puts in a group: the shims pick devices, skip accelerator-only set-up, and reset
module globals so a second build in the same worker starts clean.

* all four: :func:`load` / :func:`unchanged_environ`. Imports write ``os.environ``, and the
  harness replaces a worker whose environment changed (the next build pays a cold start).
* ai2-olmo-core 3.0.0: :func:`load` keeps ``import olmo_core`` from creating a per-process
  triton cache dir under ``/tmp/olmo-triton-cache``; :func:`olmo_fresh_world_mesh` resets the
  module global ``_WORLD_MESH`` (``build_world_mesh`` refuses a second call per process);
  :func:`olmo_num_nodes` stands in for env ``NUM_NODES`` (HSDP's default split).
* torchtitan 0.3.0: :func:`torchtitan_device`, its ``device_type`` is ``"cuda"`` on a GPU-less
  machine; :func:`register_fake_backend`, size-1 axes use ``backend_override="fake"``, a
  backend torch registers only in a test module.
* megatron-core 0.16.1: :func:`megatron_clean_state`, ``initialize_model_parallel`` asserts its
  module globals are unset.
* deepspeed 0.19.8: :func:`deepspeed_comm`, ``deepspeed.comm`` needs a backend object whose
  constructor JIT-compiles a CPU shared-memory op; :func:`deepspeed_clean_moe_state`, MoE groups
  are cached by name in module globals of ``deepspeed.utils.groups``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from meshsim import torch_private

#: Versions the shims were written and tested against (``pip install 'meshsim[...]'`` pins them).
TESTED_VERSIONS = {
    "ai2-olmo-core": "3.0.0",
    "torchtitan": "0.3.0",
    "megatron-core": "0.16.1",
    "deepspeed": "0.19.8",
    "accelerate": "1.15.0",
    "transformers": "5.23.0",
    "lightning": "2.6.6",
    "verl": "0.9.1",
    "areal": "1.0.4",
}


def device_type() -> str:
    """The device type meshes are built on: ``cuda`` under nccl, ``cpu`` otherwise (gloo, fake)."""
    import torch.distributed as dist

    return "cuda" if str(dist.get_backend()) == "nccl" else "cpu"


def load(*modules: str) -> list[ModuleType]:
    """Import framework modules, undoing whatever the imports wrote to ``os.environ``.

    The harness reuses a warm worker only when the rank's body left the environment as it found
    it (a changed variable marks the worker dirty, and the next run pays a fresh interpreter plus
    the 2-8 s framework import again, every time). The framework imports write variables that
    group construction never reads: ai2-olmo-core 3.0.0 sets ``TRITON_CACHE_DIR`` and
    ``OLMO_TRITON_CACHE_DIR_AUTO`` (and creates that directory, see below), the torch inductor
    modules the frameworks pull in set ``TORCHINDUCTOR_CACHE_DIR``, deepspeed 0.19.8 sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK``. The environment is restored exactly after importing.

    ``olmo_core/__init__.py`` also creates a per-process directory
    ``$OLMO_TRITON_CACHE_BASE/pid<N>/<host>/pid<N>`` (default base ``/tmp/olmo-triton-cache``)
    for triton, unused on CPU and for building meshes; unless the user chose a cache
    (``TRITON_CACHE_DIR`` or ``OLMO_TRITON_CACHE_BASE``) OLMo's own switch
    ``OLMO_DISABLE_PER_RANK_TRITON_CACHE`` is set during the import so no directory is left behind.
    """
    with unchanged_environ():
        if "TRITON_CACHE_DIR" not in os.environ and "OLMO_TRITON_CACHE_BASE" not in os.environ:
            os.environ["OLMO_DISABLE_PER_RANK_TRITON_CACHE"] = "1"
        return [importlib.import_module(name) for name in modules]


@contextlib.contextmanager
def unchanged_environ() -> Iterator[None]:
    """Run a build with ``os.environ`` restored afterwards (see :func:`load` for why)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != before:
            os.environ.clear()
            os.environ.update(before)


# -- ai2-olmo-core 3.0.0 ---------------------------------------------------------------------------
@contextlib.contextmanager
def olmo_fresh_world_mesh() -> Iterator[None]:
    """Let ``build_world_mesh`` run once per build instead of once per process.

    ``olmo_core.distributed.parallel.build_world_mesh`` (3.0.0) raises "world mesh already
    exists!" when its module global ``_WORLD_MESH`` is set, which a warm harness worker keeps
    from the previous build. The global is cleared before and after the build (it would also
    keep the previous run's process groups alive).
    """
    from olmo_core.distributed import parallel

    parallel._WORLD_MESH = None
    try:
        yield
    finally:
        parallel._WORLD_MESH = None


@contextlib.contextmanager
def olmo_num_nodes(num_nodes: int) -> Iterator[None]:
    """Run with env ``NUM_NODES`` set: OLMo's default HSDP split reads it (not a config field).

    ``DataParallelConfig.get_replicate_and_shard_degree`` defaults to ``NUM_NODES`` replicas
    (else world / ``LOCAL_WORLD_SIZE``); meshsim's ``num_nodes`` (default 1, as OLMo's tests)
    stands for it. The previous value is restored afterwards.
    """
    before = os.environ.get("NUM_NODES")
    os.environ["NUM_NODES"] = str(num_nodes)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NUM_NODES", None)
        else:
            os.environ["NUM_NODES"] = before


# -- torchtitan 0.3.0 ------------------------------------------------------------------------------
@contextlib.contextmanager
def torchtitan_device(device: str) -> Iterator[None]:
    """Build torchtitan's meshes on ``device`` (``cpu`` on gloo).

    ``torchtitan.tools.utils`` (0.3.0) computes ``device_type = _get_available_device_type() or
    "cuda"`` at import, so on a GPU-less machine it is ``"cuda"``, and
    ``torchtitan.distributed.parallel_dims`` imported that name into its own namespace for
    ``init_device_mesh(device_type, ...)``. That module attribute is set for the build and
    restored afterwards.
    """
    from torchtitan.distributed import parallel_dims

    before = parallel_dims.device_type
    parallel_dims.device_type = device
    try:
        yield
    finally:
        parallel_dims.device_type = before


def register_fake_backend() -> None:
    """Register torch's ``fake`` c10d backend, which torchtitan asks for by name.

    ``ParallelDims.build_mesh`` (0.3.0) unflattens axes torchtitan considers disabled (degree 1,
    ``efsdp`` without EP, ``batch`` ...) with ``backend_override={name: "fake"}``. torch
    registers that backend only when ``torch.testing._internal.distributed.fake_pg`` is
    imported (torchtitan's trainer gets it indirectly); importing it twice is harmless.
    """
    torch_private.register_fake_backend()


# -- megatron-core 0.16.1 --------------------------------------------------------------------------
@contextlib.contextmanager
def megatron_clean_state() -> Iterator[Any]:
    """``megatron.core.parallel_state`` with its globals cleared before and after the build.

    ``initialize_model_parallel`` asserts each group global is unset ("... is already
    initialized"), and a warm worker keeps the previous build's. ``destroy_model_parallel`` is
    megatron's own reset; no patch is needed for group construction on CPU (only NCCL-specific
    options, which meshsim never passes, would fail).
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    try:
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()


# -- deepspeed 0.19.8 ------------------------------------------------------------------------------
@contextlib.contextmanager
def deepspeed_comm() -> Iterator[Any]:
    """``deepspeed.comm`` usable on the harness's already-initialised default process group.

    ``PipelineParallelGrid`` and ``deepspeed.utils.groups`` call ``deepspeed.comm.new_group`` /
    ``get_rank``, which need the module global ``deepspeed.comm.comm.cdb``. The usual way to set
    it, ``deepspeed.init_distributed()``, constructs ``TorchBackend``, whose ``__init__`` (0.19.8)
    calls ``build_shm_op()``: on the CPU accelerator that JIT-compiles the ``deepspeed_shm_comm``
    op with ninja (about 25 s and a C++ compiler on first use) and then sets up shared memory
    for a fast CPU all-reduce. Group construction never uses that op, so ``build_shm_op`` is
    replaced by ``lambda: None`` while ``TorchBackend`` is constructed (it then leaves
    ``shm_comm_op`` unset, as on platforms without the op) and ``init_process_group`` sees
    torch.distributed initialised and does nothing. ``cdb`` is reset afterwards.
    """
    import torch.distributed as dist

    # Not ``from deepspeed.comm import torch``: that name is the torch package deepspeed.comm
    # imported, which shadows its submodule ``deepspeed.comm.torch``.
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    before = ds_comm.cdb
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        ds_comm.cdb = ds_torch.TorchBackend(str(dist.get_backend()), None, None)
    finally:
        ds_torch.build_shm_op = original
    try:
        yield ds_comm
    finally:
        ds_comm.cdb = before


@contextlib.contextmanager
def deepspeed_clean_moe_state() -> Iterator[Any]:
    """``deepspeed.utils.groups`` with its MoE group caches and ``mpu`` empty before and after.

    ``_create_expert_data_and_model_parallel`` (0.19.8) skips creating groups whose name
    (``ep_size_<n>``) is already cached in module-level dicts, so a warm worker would hand back
    the previous build's (destroyed) groups; the data-parallel size comes from the module global
    ``mpu``.
    """
    from deepspeed.utils import groups

    caches = (
        groups._EXPERT_PARALLEL_GROUP,
        groups._EXPERT_PARALLEL_GROUP_RANKS,
        groups._EXPERT_DATA_PARALLEL_GROUP,
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
    )

    def clear() -> None:
        for cache in caches:
            cache.clear()
        groups.mpu = None
        # AutoTP's groups are module globals too; _init_tp_mesh_device returns early when set.
        for name in (
            "_TENSOR_MODEL_PARALLEL_GROUP",
            "_MODEL_PARALLEL_GROUP",
            "_DATA_PARALLEL_GROUP",
            "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
            "_MPU_TENSOR_MODEL_PARALLEL_RANK",
        ):
            setattr(groups, name, None)

    clear()
    try:
        yield groups
    finally:
        clear()
