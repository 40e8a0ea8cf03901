"""Real verl adapter: verl 0.9.1's own engine mesh methods and dispatch bookkeeping, without Ray.

FSDP engine: an ``FSDPEngine`` made without ``__init__`` (which loads a model) and given an
engine config with ``fsdp_size`` / ``ulysses_sequence_parallel_size`` runs its own
``_init_device_mesh`` (``create_device_mesh`` and the Ulysses mesh), ``get_data_parallel_group``,
``get_data_parallel_rank`` and ``is_mp_src_rank_with_outputs``. The ranks each ``Worker`` would
register with ``_register_dispatch_collect_info`` are gathered as the controller's
``_query_dispatch_info`` does, and verl's own ``collect_nd_compute`` orders the collected ranks.
Gradient reduction: FSDP1 needs an accelerator (torch refuses CPU modules), so its groups are
replayed from ``get_sharding_strategy``'s live answer with torch's rules (HYBRID_SHARD's shard
group ``mesh_dim=1``, clamped to NO_SHARD when it holds one rank); FSDP2 runs ``fully_shard`` on
a one-layer model over verl's mesh, takes a backward step with different data on every rank,
and reports the ranks whose averaged gradients equal this rank's.

Torchtitan engine: verl imports names that torchtitan 0.3.0 lacks
(``torchtitan.components.lr_scheduler``) or that need triton (torchtitan's async-EP kernels);
those modules are stood in for during the import only, then
``TorchTitanEngine._init_device_mesh`` builds torchtitan's real ``ParallelDims`` and verl's data
rank and collect rule are read as above.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshsim.builders._common import Entry, FrameworkRejection, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation
from meshsim.model.conventions.verl import TITAN_KEYS, TITAN_KINDS

#: Modules verl's torchtitan engine imports that torchtitan 0.3.0 lacks (``lr_scheduler``) or
#: that fail without triton on a CPU machine (torchtitan's async-EP kernels, reached through
#: ``torchtitan.distributed.context_parallel``); neither is used to build meshes.
STAND_INS = (
    "torchtitan.components.lr_scheduler",
    "torchtitan.distributed.minimal_async_ep.kernels",
)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Example (world 4): ``{"ulysses_sequence_parallel_size": 2}``: rank 3's
    ``get_data_parallel_group`` is ``(1, 3)``, it shares its batch chunk (``dispatch``) with
    rank 2, and only ranks 0 and 2 are collected."""
    check_keys("verl", config)
    del world_size  # verl reads the world from torch.distributed
    strategy = config.get("strategy", "fsdp")
    if strategy == "torchtitan":
        return collect(_torchtitan(config))
    if strategy not in ("fsdp", "fsdp2"):
        raise FrameworkRejection(f"strategy {strategy} not supported", upstream="AssertionError")
    return collect(_fsdp(strategy, config))


def training_meshes(config: Mapping[str, Any]) -> tuple[Any, Any, int, int, Any]:
    """The FSDP engine's own answers for a training step: (device mesh, Ulysses mesh or None,
    ``get_data_parallel_rank()``, ``get_data_parallel_size()``, the mesh its FSDP reduces
    gradients over, or None where FSDP1's NO_SHARD clamp leaves one rank per group)."""
    check_keys("verl", config)
    engine, utils = _fsdp_engine(config)
    root = engine.device_mesh
    grad = root
    if config.get("strategy", "fsdp") == "fsdp" and _fsdp1_reduce(utils, root).size() == 1:
        grad = None
    return (
        root,
        engine.ulysses_device_mesh,
        engine.get_data_parallel_rank(),
        engine.get_data_parallel_size(),
        grad,
    )


def _fsdp_engine(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """An ``FSDPEngine`` (no model) after its own ``_init_device_mesh``, and verl's fsdp utils."""
    impl, utils = _shims.load(
        "verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine.fsdp.utils"
    )
    engine = object.__new__(impl.FSDPEngine)
    engine.engine_config = _engine_config(
        fsdp_size=config.get("fsdp_size", -1),
        ulysses_sequence_parallel_size=config.get("ulysses_sequence_parallel_size", 1),
    )
    with _device(impl, utils), framework_refusals():
        engine._init_device_mesh()
    return engine, utils


def _engine_config(**fields: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


def _fsdp(strategy: str, config: Mapping[str, Any]) -> dict[str, Entry]:
    engine, utils = _fsdp_engine(config)
    root = engine.device_mesh
    ulysses = engine.ulysses_device_mesh
    entries: dict[str, Entry] = {
        "device_mesh": root,
        "fsdp": root["fsdp"],
        "ddp": _or_error(lambda: root["ddp"]),  # KeyError on verl's 1-D mesh
        "fsdp_reduce": _fsdp1_reduce(utils, root) if strategy == "fsdp" else _fsdp2_reduce(root),
        "dp": _or_error(lambda: ulysses["dp"]),
        "sp": _or_error(lambda: ulysses["sp"]),
        "get_data_parallel_group": engine.get_data_parallel_group(),
    }
    entries.update(_dispatch(engine.get_data_parallel_rank(), engine.is_mp_src_rank_with_outputs()))
    return entries


@contextlib.contextmanager
def _device(impl: Any, utils: Any) -> Iterator[None]:
    """Build on the harness's device type. verl 0.9.1 picks its platform once per process and,
    finding no accelerator, falls back to "nvidia" (``get_device_name() == "cuda"``) with only
    a warning: ``create_device_mesh`` calls ``get_device_name`` and ``FSDPEngine`` reads its
    module global ``device_name`` (set at import), so both are pointed at the harness's device
    for the build and restored afterwards."""
    device = _shims.device_type()
    before = impl.device_name, utils.get_device_name
    impl.device_name, utils.get_device_name = device, lambda: device
    try:
        yield
    finally:
        impl.device_name, utils.get_device_name = before


def _or_error(get: Any) -> Entry:
    try:
        return get()  # type: ignore[no-any-return]
    except Exception as error:  # e.g. ulysses_device_mesh is None without Ulysses
        return error


def _fsdp1_reduce(utils: Any, root: Any) -> Entry:
    """FSDP1's gradient group for verl's sharding strategy, by torch's rules (FSDP1 refuses
    CPU modules: "FSDP needs a non-CPU accelerator device")."""
    from torch.distributed.fsdp import ShardingStrategy

    # verl's FSDP engine passes reshard_after_forward (default True) as zero3_enable; False
    # swaps in the ZeRO-2 twins, which pick the same groups.
    chosen = utils.get_sharding_strategy(root, zero3_enable=True)
    hybrid = chosen == ShardingStrategy.HYBRID_SHARD
    group = root.get_group(1) if hybrid else root.get_group(0)
    if group.size() == 1:  # _init_core_state: world size 1 -> NO_SHARD, reduced over `group`
        return group
    return root if hybrid else group


def _fsdp2_reduce(root: Any) -> Entry:
    """The ranks whose gradients FSDP2 averaged with this rank's, found by a backward step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4, bias=False)
    fully_shard(layer, mesh=root)
    rank = dist.get_rank()
    layer(torch.full((2, 4), float(rank + 1))).square().sum().backward()
    grad = layer.weight.grad.full_tensor()
    grads: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(grads, grad)
    return tuple(r for r, g in enumerate(grads) if torch.allclose(g, grad))


def _dispatch(dp_rank: int, is_collect: bool) -> dict[str, Entry]:
    """What the single controller reads off every worker's registered dispatch info."""
    worker_module, group_module, decorator = _shims.load(
        "verl.single_controller.base.worker",
        "verl.single_controller.base.worker_group",
        "verl.single_controller.base.decorator",
    )
    worker = object.__new__(worker_module.Worker)
    worker._Worker__dispatch_dp_rank, worker._Worker__collect_dp_rank = {}, {}
    worker._register_dispatch_collect_info("train", dp_rank=dp_rank, is_collect=is_collect)
    registered = (worker._query_dispatch_info("train"), worker.query_collect_info("train"))
    infos: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(infos, registered)  # the controller's ONE_TO_ALL query
    mapping = [info[0] for info in infos]
    group = object.__new__(group_module.WorkerGroup)
    group._workers = list(range(len(infos)))
    collected = decorator.collect_nd_compute([info[1] for info in infos], group, group._workers)
    rank = dist.get_rank()
    return {
        "dispatch": tuple(r for r, d in enumerate(mapping) if d == mapping[rank]),
        "collect": tuple(collected) if rank in collected else None,
    }


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """Empty modules for the names verl's torchtitan engine imports but never calls here."""
    added = [name for name in STAND_INS if _missing(name)]
    for name in added:
        module = types.ModuleType(name)
        module.__getattr__ = _placeholder  # type: ignore[method-assign]
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _placeholder(attr: str) -> type:
    """A stand-in module's attribute: a fresh class (verl only names them at import)."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


def _missing(name: str) -> bool:
    if name.endswith(".kernels"):  # present, but imports triton
        return importlib.util.find_spec("triton") is None
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True


def _torchtitan(config: Mapping[str, Any]) -> dict[str, Entry]:
    _shims.register_fake_backend()
    with _stand_ins():
        (impl,) = _shims.load("verl.workers.engine.torchtitan.transformer_impl")
    engine = object.__new__(impl.TorchTitanEngine)
    sizes = {key: config.get(key, 1) for key in TITAN_KEYS}
    engine.engine_config = _engine_config(**sizes)
    threads = torch.autograd.is_multithreading_enabled()
    try:
        with _shims.torchtitan_device(_shims.device_type()), framework_refusals():
            engine._init_device_mesh()
            dp_rank = engine.get_data_parallel_rank()
    finally:
        torch.autograd.set_multithreading_enabled(threads)
    dims = engine.parallel_dims
    entries: dict[str, Entry] = {}
    for name in TITAN_KINDS:
        entries[name] = _or_error(lambda name=name: dims.get_mesh(name))
    entries["get_data_parallel_group"] = engine.get_data_parallel_group()
    entries.update(_dispatch(dp_rank, engine.is_mp_src_rank_with_outputs()))
    return entries
