"""transformers builder: ``DistributedConfig`` -> dense, expert and Trainer meshes, on live torch.

Replays transformers 5.23.0 with plain torch: ``DistributedConfig.__post_init__`` resolves and
validates the sizes, ``initialize_distributed_mesh`` checks their product against the world and
calls ``init_device_mesh`` twice (dense ``(pp, dp_replicate, fsdp, tp)``, expert ``(pp,
dp_replicate, efsdp, ep)``), and the sub-meshes transformers slices are sliced off the live
meshes (``get_mesh(("dp_replicate", "fsdp"))`` for FSDP2, ``("pp", "fsdp", "tp")`` for
``model._device_mesh``). When tp > 1 the Trainer's hand-off, ``ParallelismConfig(tp_size=tp,
dp_shard_size=dp_replicate * fsdp)``, is replayed by meshsim's accelerate builder and its groups
renamed ``trainer:*``; a refusal there leaves ``trainer:tp`` absent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim.builders._common import Entry, FrameworkRejection, collect, mesh, reference_rules
from meshsim.checks import Observation
from meshsim.model.conventions import transformers

_SIZE_KEYS = ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size", "ep_size")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Every transformers mesh for ``config`` on this rank, observed by kind name."""
    pp, dp_replicate, fsdp, tp, ep = distributed_config(world_size, config)
    if (pp, dp_replicate, fsdp, tp) == (1, 1, 1, 1):
        names = ("pp", "dp_replicate", "fsdp", "tp", "fsdp_mesh", "device_mesh")
        experts = ("pp", "dp_replicate", "efsdp", "ep", "fsdp_mesh")
        empty: dict[str, Entry] = dict.fromkeys(names)
        empty.update(dict.fromkeys("expert:" + n for n in experts))
        return collect(empty)
    dense, expert = initialize_distributed_mesh(world_size, pp, dp_replicate, fsdp, tp, ep)
    entries: dict[str, Entry] = {dim: dense[dim] for dim in dense.mesh_dim_names or ()}
    entries["fsdp_mesh"] = dense[_fsdp_dims(dp_replicate, "fsdp")]
    entries["device_mesh"] = dense[("pp", "fsdp", "tp")]
    for dim in expert.mesh_dim_names or ():
        entries["expert:" + dim] = expert[dim]
    entries["expert:fsdp_mesh"] = expert[_fsdp_dims(dp_replicate, "efsdp")]
    observed = collect(entries)
    pc = config.get("parallelism_config")
    return observed.merged(_trainer(world_size, tp, dp_replicate * fsdp, pc))


def meshes(world_size: int, config: Mapping[str, Any]) -> dict[str, DeviceMesh]:
    """The meshes a transformers job holds, named as the reference names them (``meshsim
    meshes``): ``main`` (dense), ``expert`` and, for a tensor-parallel model, the Trainer's
    accelerate mesh ``trainer``; none when every size is 1."""
    pp, dp_replicate, fsdp, tp, ep = distributed_config(world_size, config)
    if (pp, dp_replicate, fsdp, tp) == (1, 1, 1, 1):
        return {}
    dense, expert = initialize_distributed_mesh(world_size, pp, dp_replicate, fsdp, tp, ep)
    built = {"main": dense, "expert": expert}
    trainer = trainer_mesh(world_size, tp, dp_replicate * fsdp)
    if trainer is not None:
        built["trainer"] = trainer
    return built


def trainer_mesh(world_size: int, tp: int, dp_size: int) -> DeviceMesh | None:
    """The mesh of the Trainer's ``ParallelismConfig(tp_size=tp, dp_shard_size=dp_size)``: none
    for a model without TP (the Trainer builds no config) or where accelerate refuses it."""
    if tp == 1:
        return None
    from meshsim.builders import accelerate

    try:
        return accelerate.meshes(world_size, _trainer_config(tp, dp_size)).get("main")
    except FrameworkRejection:
        return None


def distributed_config(world_size: int, config: Mapping[str, Any]) -> tuple[int, ...]:
    """``DistributedConfig.__post_init__``: (pp, dp_replicate, fsdp, tp, ep) or its ValueError,
    by the convention's rules; ``world_size`` stands in for ``WORLD_SIZE``."""
    with reference_rules():
        sizes = transformers.resolve(world_size, config)
    return tuple(sizes[key] for key in _SIZE_KEYS)


def initialize_distributed_mesh(
    world_size: int, pp: int, dp_replicate: int, fsdp: int, tp: int, ep: int
) -> tuple[DeviceMesh, DeviceMesh]:
    """The world check, then the dense and the expert ``init_device_mesh``, in that order."""
    shape = (pp, dp_replicate, fsdp, tp)
    if math.prod(shape) != dist.get_world_size():
        raise FrameworkRejection(
            f"The parallel mesh requires {math.prod(shape)} processes, but world_size is "
            f"{world_size}.",
            upstream="RuntimeError",
        )
    dense = mesh(shape, ("pp", "dp_replicate", "fsdp", "tp"))
    expert = mesh((pp, dp_replicate, fsdp * tp // ep, ep), ("pp", "dp_replicate", "efsdp", "ep"))
    return dense, expert


def _fsdp_dims(dp_replicate: int, shard: str) -> tuple[str, ...]:
    """``apply_fully_sharded_data_parallelism`` slices HSDP's 2-D mesh only with replicas."""
    return ("dp_replicate", shard) if dp_replicate > 1 else (shard,)


def _trainer(world_size: int, tp: int, dp_size: int, pc: Any = None) -> Observation:
    """``Trainer._build_accelerator_args``' ``ParallelismConfig`` (the given one, with the TP
    model's ``tp_size`` and ``dp_shard_size``), built by meshsim's accelerate builder, groups
    renamed ``trainer:*``."""
    from meshsim.builders import accelerate

    try:
        with reference_rules():
            handed = transformers.trainer_parallelism(tp, dp_size, pc) or {}
        built = accelerate.build(world_size, {**handed, "distributed_type": "MULTI_GPU"})
    except FrameworkRejection:
        return Observation(
            dist.get_rank(), world_size, str(dist.get_backend()), {}, absent=("trainer:tp",)
        )
    # Without a ParallelismConfig accelerate builds no mesh: only its loader is the Trainer's.
    kept = (lambda n: n.startswith("dataloader_")) if not handed else (lambda n: True)
    groups = {
        "trainer:" + name: dataclasses.replace(view, name="trainer:" + name)
        for name, view in built.groups.items()
        if kept(name)
    }
    absent = tuple("trainer:" + name for name in built.absent if kept(name))
    return Observation(built.rank, built.world_size, built.backend, groups, absent=absent)


def _trainer_config(tp: int, dp_size: int) -> dict[str, Any]:
    """meshsim's accelerate config for the Trainer's ``ParallelismConfig``: the model was
    sharded by transformers at load time, so no accelerate FSDP plugin (a multi-GPU launch)."""
    return {"tp_size": tp, "dp_shard_size": dp_size, "distributed_type": "MULTI_GPU"}
