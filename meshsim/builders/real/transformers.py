"""Real transformers adapter: ``DistributedConfig``, ``initialize_distributed_mesh``, the Trainer.

``build(world_size, config)`` makes transformers' own ``DistributedConfig(**config)`` (its
``__post_init__`` resolves and validates the sizes), hands it to
``DistributedMixin.prepare_distribute_model`` (the classmethod ``from_pretrained`` calls, which
calls ``initialize_distributed_mesh``) and observes the ``TransformersDeviceMesh`` it returns:
every dense dim through ``get_mesh(dim)``, the expert mesh's dims (``expert:*``), and the
sub-meshes transformers slices with the same ``get_mesh`` calls its code makes (``fsdp_mesh``
as in ``apply_fully_sharded_data_parallelism``, ``device_mesh`` as in ``maybe_distribute_model``).

The Trainer's hand-off runs transformers' own ``Trainer._build_accelerator_args`` on a stand-in
Trainer (``args`` with the fields it reads, ``model`` with the ``tp_size`` and
``config.distributed_config`` that ``maybe_distribute_model`` sets on a loaded model): no model,
dataset or training loop is needed for the ``ParallelismConfig`` it builds. That config then
goes through the two calls ``Accelerator.__init__`` makes with it, accelerate's own
``ParallelismConfig.get_device_mesh(device)`` and ``_validate_accelerator``; the latter on a
stand-in accelerator describing a multi-GPU launch of this world (accelerate refuses a
``ParallelismConfig`` on a multi-CPU launch, so a real ``Accelerator`` on the gloo world would
never reach the mesh a GPU job gets). Its dims and flattened names are observed as
``trainer:*`` (a name accelerate never created is recorded with torch's ``KeyError``), and so
are the groups accelerate's own ``prepare_data_loader`` forms over that mesh, read off the
batches each rank loads; a refusal leaves ``trainer:tp`` absent.
Tested with transformers 5.23.0 and accelerate 1.15.0 (``pip install 'meshsim[transformers]'``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from meshsim import torch_private
from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation

_DENSE_KINDS = ("pp", "dp_replicate", "fsdp", "tp", "fsdp_mesh", "device_mesh")
_EXPERT_KINDS = ("pp", "dp_replicate", "efsdp", "ep", "fsdp_mesh")
#: accelerate's mesh dims and flattened names (``_get_mesh``'s order, ``build_device_mesh``'s).
_ACCELERATE_NAMES = ("dp_replicate", "dp_shard", "cp", "sp", "tp", "dp", "dp_shard_cp", "dp_cp")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run transformers' mesh code (and the Trainer's hand-off) for ``config`` on this rank.

    Example (world 8): ``{"fsdp_size": 4, "tp_size": 2, "ep_size": 4}`` builds the dense mesh
    (1, 1, 4, 2) and the expert mesh (1, 1, 2, 4); rank 5 observes ``tp`` (4, 5), ``expert:ep``
    (4, 5, 6, 7), ``expert:efsdp`` (1, 5) and ``trainer:tp`` (4, 5).
    """
    check_keys("transformers", config)
    distributed, mixin, trainer = _shims.load(
        "transformers.distributed", "transformers.distributed.mixin", "transformers.trainer"
    )
    with _shims.unchanged_environ(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # enable_expert_parallel's deprecation
        # DistributedConfig derives tp_size from env WORLD_SIZE when only tp_plan is given.
        os.environ["WORLD_SIZE"] = str(dist.get_world_size())
        with framework_refusals():
            distributed_config = distributed.DistributedConfig(**_model_keys(config))
            _, _, manager = mixin.DistributedMixin.prepare_distribute_model(distributed_config)
        entries = _mesh_entries(manager, distributed_config)
        observed = collect(entries)
        trainer_entries = _trainer_entries(trainer.Trainer, distributed_config, config)
        if trainer_entries:
            observed = observed.merged(collect(trainer_entries))
        return observed


def _mesh_entries(manager: Any, config: Any) -> dict[str, Entry]:
    """The ``TransformersDeviceMesh``'s meshes by kind; every kind None when none was built."""
    if manager is None:
        entries: dict[str, Entry] = dict.fromkeys(_DENSE_KINDS)
        entries.update(dict.fromkeys("expert:" + name for name in _EXPERT_KINDS))
        return entries
    entries = {dim: manager.get_mesh(dim) for dim in manager._dense_mesh.mesh_dim_names}
    # apply_fully_sharded_data_parallelism's choice, and maybe_distribute_model's device mesh.
    hsdp = config.dp_replicate_size > 1
    entries["fsdp_mesh"] = manager.get_mesh(("dp_replicate", "fsdp") if hsdp else "fsdp")
    entries["device_mesh"] = manager.get_mesh(("pp", "fsdp", "tp"))
    # get_mesh sends "pp" and "dp_replicate" to the dense mesh: read the expert root directly.
    expert = manager._expert_mesh
    for dim in expert.mesh_dim_names:
        entries["expert:" + dim] = expert[dim]
    entries["expert:fsdp_mesh"] = manager.get_mesh(("dp_replicate", "efsdp") if hsdp else "efsdp")
    return entries


def training_meshes(config: Mapping[str, Any]) -> tuple[int, Any, Any]:
    """What a Trainer run of ``config`` holds, from transformers' own code: (pp size, a function
    returning FSDP2's mesh as ``apply_fully_sharded_data_parallelism`` slices it and the TP mesh,
    the Trainer's accelerate mesh or None where it builds none: no TP, or refused). The model's
    meshes are sliced when the function is called (see ``meshsim.dataflow.meshes``)."""
    check_keys("transformers", config)
    distributed, mixin, trainer = _shims.load(
        "transformers.distributed", "transformers.distributed.mixin", "transformers.trainer"
    )
    with _shims.unchanged_environ(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        os.environ["WORLD_SIZE"] = str(dist.get_world_size())
        with framework_refusals():
            distributed_config = distributed.DistributedConfig(**_model_keys(config))
            _, _, manager = mixin.DistributedMixin.prepare_distribute_model(distributed_config)
        if manager is None:
            return 1, lambda: (None, None), None
        hsdp = distributed_config.dp_replicate_size > 1
        tp_size = distributed_config.tp_size

        def model_meshes() -> tuple[Any, Any]:
            grad = manager.get_mesh(("dp_replicate", "fsdp") if hsdp else "fsdp")
            return grad, manager.get_mesh("tp") if tp_size > 1 else None

        mesh = _trainer_mesh(trainer.Trainer, distributed_config, config)
        trainer_mesh = None if isinstance(mesh, Exception) else mesh
        return distributed_config.pp_size, model_meshes, trainer_mesh


def _model_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` less ``parallelism_config``, which is the Trainer's (TrainingArguments), not
    ``DistributedConfig``'s."""
    return {k: v for k, v in config.items() if k != "parallelism_config"}


def _trainer_entries(trainer_class: Any, config: Any, keys: Mapping[str, Any]) -> dict[str, Entry]:
    """The mesh ``Trainer._build_accelerator_args``' ParallelismConfig makes, as ``trainer:*``;
    empty when the Trainer builds none (the model is not tensor parallel)."""
    mesh = _trainer_mesh(trainer_class, config, keys)
    if mesh is None:  # no ParallelismConfig: accelerate's loader over every process, no mesh
        return _loader_groups(None)
    if isinstance(mesh, Exception):
        return {"trainer:tp": mesh}
    entries: dict[str, Entry] = {}
    for name in _ACCELERATE_NAMES:  # a name accelerate never created: torch's KeyError, absent
        try:
            entries["trainer:" + name] = mesh[name]
        except KeyError as missing:
            entries["trainer:" + name] = missing
    for alias, flat in torch_private.flatten_mapping(mesh).items():
        entries.setdefault("trainer:" + alias, flat)
    entries.update(_loader_groups(mesh))
    return entries


def _trainer_mesh(trainer_class: Any, config: Any, keys: Mapping[str, Any]) -> Any:
    """The device mesh of the ``ParallelismConfig`` ``Trainer._build_accelerator_args`` makes,
    as ``Accelerator.__init__`` builds and validates it: None when the Trainer makes no config,
    accelerate's exception where it refuses one."""
    stand_in = SimpleNamespace(
        args=SimpleNamespace(
            mixed_precision="no",
            deepspeed_plugin=None,
            ddp_find_unused_parameters=False,
            ddp_bucket_cap_mb=None,
            ddp_broadcast_buffers=None,
            ddp_static_graph=None,
            parallelism_config=_given_parallelism(keys.get("parallelism_config")),
            torch_compile_backend="inductor",
            torch_compile_mode=None,
        ),
        model=SimpleNamespace(
            tp_size=config.tp_size, config=SimpleNamespace(distributed_config=config)
        ),
    )
    parallelism = trainer_class._build_accelerator_args(stand_in).get("parallelism_config")
    if parallelism is None:
        return None
    from accelerate.utils import DistributedType

    accelerator = SimpleNamespace(
        multi_device=True,
        num_processes=dist.get_world_size(),
        is_fsdp2=False,
        distributed_type=DistributedType.MULTI_GPU,
        is_main_process=dist.get_rank() == 0,
    )
    try:
        # Accelerator.__init__'s order: build the mesh, then validate the config against it.
        mesh = parallelism.get_device_mesh(_shims.device_type())
        parallelism._validate_accelerator(accelerator)
    except (ValueError, RuntimeError) as refusal:
        return refusal
    return mesh


def _loader_groups(mesh: Any) -> dict[str, Entry]:
    """Which ranks accelerate's ``prepare_data_loader`` (given the Trainer's mesh) hands the
    same batches, and which different ones, read off the batches themselves: every rank loads
    its first batches, all ranks exchange them, equal batches make ``dataloader_batch_peers``
    and a rank's place among its peers picks its ``dataloader_replica`` (the data-parallel
    group, in data-index order)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from torch.utils.data import DataLoader

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        loader = prepare_data_loader(
            DataLoader(list(range(4 * world)), batch_size=1),
            num_processes=world,
            process_index=rank,
            torch_device_mesh=mesh,
        )
        mine = tuple(int(batch.item()) for batch, _ in zip(loader, range(2), strict=False))
    finally:
        PartialState._reset_state()  # prepare_data_loader made the process-wide singleton
    batches: list[Any] = [None] * world
    dist.all_gather_object(batches, mine)
    by_batches: dict[Any, list[int]] = {}
    for other, seen in enumerate(batches):
        by_batches.setdefault(seen, []).append(other)
    peers = by_batches[mine]
    place = peers.index(rank)
    replica = tuple(by_batches[key][place] for key in sorted(by_batches))
    return {
        "trainer:dataloader_batch_peers": tuple(peers),
        "trainer:dataloader_replica": replica,
    }


def _given_parallelism(given: Any) -> Any:
    """``TrainingArguments.parallelism_config``: accelerate's ParallelismConfig of the dict."""
    if not given:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(**given)
