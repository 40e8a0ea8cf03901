"""The meshes a trainer hands its data loader and its model wrapper, built each framework's way.

OLMo-core: ``build_world_mesh`` then ``get_dp_process_group`` for the loader and
``get_dp_model_mesh`` for FSDP/DDP; torchtitan: ``ParallelDims.build_mesh`` then the ``batch``
mesh for the loader and ``["dp_replicate", "fsdp"]`` for FSDP; accelerate, Lightning,
transformers (two meshes: the model's and its Trainer's) and verl: see their functions. Without
``real`` the plain-torch replays in :mod:`meshsim.builders` build them; with ``real`` the
installed framework does. The reference is never read here: the recipe must stand on the
framework's own wiring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.errors import UsageError

FRAMEWORKS = ("olmo-core", "torchtitan", "accelerate", "lightning", "transformers", "verl")


@dataclass
class TrainerMeshes:
    """What a trainer reads off its parallel state (``None`` when a degree is 1 or absent)."""

    data_rank: int
    data_size: int
    #: Where gradients are reduced: 1-D (FSDP / DDP) or 2-D (HSDP: replicate, shard).
    grad: DeviceMesh | None
    #: The data-loading mesh as a real mesh (what the wrong wiring wraps the model over).
    data: DeviceMesh | None
    tp: DeviceMesh | None
    cp_rank: int
    cp_size: int
    pp_rank: int
    ddp: bool

    def gradient_flat(self) -> DeviceMesh | None:
        """The gradient mesh flattened to one dim (what the wrong sampler splits over), made
        only when asked: before torch 2.10 flattening a mesh that holds a flattened dim fails,
        and the right wiring never needs it."""
        return _flat(self.grad, "meshsim_grad")


def build(framework: str, world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    recipes = {
        "olmo-core": _olmo,
        "torchtitan": _torchtitan,
        "accelerate": _accelerate,
        "lightning": _lightning,
        "transformers": _transformers,
        "verl": _verl,
    }
    if framework not in recipes:
        raise UsageError(
            f"the data-flow recipe exists for {', '.join(FRAMEWORKS)}, not {framework!r}"
        )
    return recipes[framework](world_size, config, real)


def _local(mesh: Any) -> tuple[int, int]:
    if mesh is None:
        return 0, 1
    if isinstance(mesh, DeviceMesh):
        return mesh.get_local_rank(), mesh.size()
    return dist.get_rank(mesh), dist.get_world_size(mesh)


def _flat(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    if mesh is None or mesh.ndim == 1:
        return mesh
    return torch_private.flatten(mesh, name)


# -- OLMo-core ------------------------------------------------------------------------------------
def _olmo(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    if real:
        from meshsim.builders.real import _shims
        from meshsim.builders.real.olmo_core import _configs

        (parallel,) = _shims.load("olmo_core.distributed.parallel")
        stack = contextlib.ExitStack()
        stack.enter_context(_shims.unchanged_environ())
        stack.enter_context(_shims.olmo_fresh_world_mesh())
        stack.enter_context(_shims.olmo_num_nodes(config.get("num_nodes") or 1))
        with stack:
            root = parallel.build_world_mesh(**_configs(parallel, config), device_type="cpu")
            return _olmo_getters(root, config, parallel)
    from meshsim.builders import olmo_core as parallel_plain

    root = parallel_plain.build_world_mesh(world_size, config)
    return _olmo_getters(root, config, _PlainOlmo(parallel_plain))


class _PlainOlmo:
    """meshsim's OLMo replay under OLMo's getter names."""

    def __init__(self, module: Any) -> None:
        self._getters = module.GETTERS

    def __getattr__(self, name: str) -> Any:
        return self._getters[name]


def _olmo_getters(root: DeviceMesh, config: Mapping[str, Any], parallel: Any) -> TrainerMeshes:
    names = [str(getattr(n, "value", n)) for n in root.mesh_dim_names or ()]
    data_rank, data_size = _local(parallel.get_dp_process_group(root))
    data = parallel.get_dp_mesh(root)
    data = _flat(data, "meshsim_data")
    # Without a data-parallel config OLMo applies no DDP/FSDP: nothing reduces the gradients.
    grad = parallel.get_dp_model_mesh(root) if config.get("dp") is not None else None
    tp = parallel.get_tp_mesh(root) if "tp" in names else None
    cp_rank, cp_size = _local(parallel.get_cp_mesh(root) if "cp" in names else None)
    pp_rank, _ = _local(parallel.get_pp_mesh(root) if "pp" in names else None)
    dp = str(getattr(config.get("dp"), "value", config.get("dp")))
    return TrainerMeshes(
        data_rank, data_size, grad, data, tp, cp_rank, cp_size,
        pp_rank, ddp=dp == "ddp",
    )  # fmt: skip


# -- torchtitan -----------------------------------------------------------------------------------
_TT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def _torchtitan(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    from meshsim.builders._common import mesh
    from meshsim.builders.torchtitan import _validate

    if config.get("version", "current") != "current":
        raise UsageError("the torchtitan data-flow recipe follows version='current' only")
    raw = {k: config.get(k, -1 if k == "dp_shard" else 1) for k in _TT_KEYS}
    d = _validate(world_size, raw, with_etp=False)
    pp, dpr, dps, cp, tp = (d[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    world = mesh((world_size,), ("world",))
    # The loader's view (pp, batch, cp, tp), with real groups (torchtitan backs batch with the
    # fake backend: the loader only reads its rank and size).
    loading = torch_private.unflatten(
        world, 0, (pp, dpr * dps, cp, tp), ("pp", "batch", "cp", "tp"), emulate=True
    )
    if real:
        from meshsim.builders.real import _shims
        from meshsim.builders.real.torchtitan import parallel_dims

        _shims.register_fake_backend()
        dims = parallel_dims(world_size, {**config, "spmd_backend": "partial_dtensor"})
        with _shims.unchanged_environ(), _shims.torchtitan_device("cpu"):
            dims.build_mesh()
        get = dims.get_optional_mesh
        batch = get("batch")
        names = ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]
        grad = dims.get_mesh(names)  # torchtitan 0.3.0 always applies FSDP2 (shard 1: a no-op)
        tp_mesh, cp_mesh, pp_mesh = get("tp"), get("cp"), get("pp")
    else:
        dense = torch_private.unflatten(
            world, 0, (pp, dpr, dps * cp, tp), ("pp", "dp_replicate", "fsdp", "tp"), emulate=True
        )
        batch = loading["batch"] if dpr * dps > 1 else None
        grad = dense["dp_replicate", "fsdp"] if dpr > 1 else dense["fsdp"]
        tp_mesh = dense["tp"] if tp > 1 else None
        cp_mesh = loading["cp"] if cp > 1 else None
        pp_mesh = loading["pp"] if pp > 1 else None
    data_rank, data_size = _local(batch)
    cp_rank, cp_size = _local(cp_mesh)
    pp_rank, _ = _local(pp_mesh)
    return TrainerMeshes(
        data_rank, data_size, grad, loading["batch"], tp_mesh,
        cp_rank, cp_size, pp_rank, ddp=dps * cp == 1,
    )  # fmt: skip


# -- accelerate -----------------------------------------------------------------------------------
def _accelerate(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    """``Accelerator``'s wiring: ``prepare_data_loader``'s (process_index, num_processes) for the
    loader, ``mesh[fsdp_dim_names]`` for FSDP2 (no mesh: the world), DDP over the world group,
    no wrapper for TP alone."""
    from meshsim.builders import accelerate as plain
    from meshsim.builders._common import mesh

    version, kind, sizes, _ = plain.settings(config)
    if kind == "DEEPSPEED":
        raise UsageError("the accelerate data-flow recipe follows FSDP2 and DDP, not DeepSpeed")
    if config.get("dispatch_batches"):
        raise UsageError(
            "the accelerate data-flow recipe shards batches as prepare_data_loader "
            "does; dispatch_batches is modelled by the reference and adapters only"
        )
    if real:
        from meshsim.builders.real import accelerate as adapter

        kind, _, root = adapter.device_mesh(world_size, config)
        with adapter.loader_state(world_size, kind):
            sampler = adapter.prepare_loader(world_size, root).batch_sampler
        data_rank = getattr(sampler, "process_index", 0)
        data_size = getattr(sampler, "num_processes", 1)
    else:
        plain.check_world(world_size, config)
        root = plain.build_device_mesh(version, sizes)
        data_rank, data_size = plain.loader_rank(world_size, kind, root)
    names = tuple(root.mesh_dim_names or ()) if root is not None else ()
    grad: DeviceMesh | None = None
    if kind == "FSDP" and root is not None:
        grad = root[(("dp_replicate",) if "dp_replicate" in names else ()) + ("dp_shard_cp",)]
    elif kind == "FSDP" or sizes["tp"] == 1:
        grad = mesh((world_size,), ("world",))
    data = root["dp"] if "dp_replicate" in names or "dp_shard" in names else None
    cp_rank, cp_size = _local(root["cp"] if "cp" in names else None)
    return TrainerMeshes(
        data_rank, data_size, grad, data,
        root["tp"] if "tp" in names else None, cp_rank, cp_size, 0, ddp=kind == "MULTI_GPU",
    )  # fmt: skip


# -- Lightning ------------------------------------------------------------------------------------
def _lightning(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    """``ModelParallelStrategy``'s wiring: the sampler takes ``distributed_sampler_kwargs`` (the
    ``data_parallel`` dim); ``configure_model`` shards over ``device_mesh["data_parallel"]`` and
    ``device_mesh["tensor_parallel"]``, as Lightning's own examples do (the user writes it)."""
    from meshsim.builders._common import mesh

    if real:
        from meshsim.builders.real import lightning as adapter

        strategy = adapter.set_up("pytorch", world_size, config)
        root = strategy.device_mesh
        kwargs = strategy.distributed_sampler_kwargs
        data_rank, data_size = kwargs["rank"], kwargs["num_replicas"]
    else:
        from meshsim.builders import lightning as plain

        root = mesh(plain.sizes(world_size, config), ("data_parallel", "tensor_parallel"))
        data_rank, data_size = _local(root["data_parallel"])
    data, tp = root["data_parallel"], root["tensor_parallel"]
    return TrainerMeshes(
        data_rank, data_size, data, data, tp if tp.size() > 1 else None, 0, 1, 0, ddp=False
    )


# -- transformers ---------------------------------------------------------------------------------
def _transformers(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    """Two meshes, one job: the model is sharded on transformers' own mesh (FSDP2 over
    ``get_mesh(("dp_replicate", "fsdp"))``, or ``"fsdp"`` without replicas; TP over ``"tp"``),
    while the Trainer's loader splits batches as accelerate does over the mesh of the
    ``ParallelismConfig(tp_size, dp_shard_size)`` it builds for a TP model (none otherwise:
    every rank a replica).

    The model's meshes are sliced last, as in a job, where the model is sharded before the
    Trainer's loader runs: torch < 2.10 keys sub-meshes by value, so the Trainer mesh's equal
    ``tp`` sub-mesh, sliced later, would become their root (FSDP2 then refuses the model).
    """
    if real:
        from meshsim.builders.real import transformers as adapter

        pp, model_meshes, trainer = adapter.training_meshes(config)
    else:
        pp, model_meshes, trainer = _transformers_plain(world_size, config)
    # The dense mesh is (pp, dp_replicate, fsdp, tp), row-major: a rank's stage is its block.
    pp_rank = dist.get_rank() // (world_size // pp)
    if trainer is None:
        data_rank, data_size, data = dist.get_rank(), world_size, None
    else:
        if real:
            from meshsim.builders.real import accelerate as adapter

            with adapter.loader_state(world_size, "MULTI_GPU"):
                sampler = adapter.prepare_loader(world_size, trainer).batch_sampler
            data_rank = getattr(sampler, "process_index", 0)
            data_size = getattr(sampler, "num_processes", 1)
        else:
            from meshsim.builders import accelerate

            data_rank, data_size = accelerate.loader_rank(world_size, "MULTI_GPU", trainer)
        # The Trainer's data-parallel dim, when accelerate kept one.
        data = trainer["dp_shard"] if "dp_shard" in (trainer.mesh_dim_names or ()) else None
    grad, tp = model_meshes()
    if grad is None and tp is None:  # recipes.unsupported says why
        raise UsageError(f"no transformers data-flow recipe for {dict(config)}")
    return TrainerMeshes(data_rank, data_size, grad, data, tp, 0, 1, pp_rank, ddp=False)


def _transformers_plain(world_size: int, config: Mapping[str, Any]) -> tuple[int, Any, Any]:
    """(pp size, the model meshes' slicer, the Trainer's mesh), by the plain-torch builder."""
    from meshsim.builders import transformers as plain

    pp, dp_replicate, fsdp, tp, ep = plain.distributed_config(world_size, config)
    if (pp, dp_replicate, fsdp, tp) == (1, 1, 1, 1):
        return 1, lambda: (None, None), None  # no mesh, no wrapper
    dense, _ = plain.initialize_distributed_mesh(world_size, pp, dp_replicate, fsdp, tp, ep)

    def model_meshes() -> tuple[Any, Any]:
        grad = dense[("dp_replicate", "fsdp") if dp_replicate > 1 else ("fsdp",)]
        return grad, dense["tp"] if tp > 1 else None

    return pp, model_meshes, plain.trainer_mesh(world_size, tp, dp_replicate * fsdp)


# -- verl -----------------------------------------------------------------------------------------
def _verl(world_size: int, config: Mapping[str, Any], real: bool) -> TrainerMeshes:
    """The FSDP engine's wiring: the controller hands batch chunk i to the workers whose
    ``get_data_parallel_rank()`` is i (the Ulysses mesh's ``dp`` rank, else the global rank),
    Ulysses peers split each sequence (the ``sp`` dim), and FSDP reduces gradients over the
    device mesh, or over no other rank where FSDP1's NO_SHARD clamp applies."""
    if real:
        from meshsim.builders.real import verl as adapter

        root, ulysses, data_rank, data_size, grad = adapter.training_meshes(config)
    else:
        from meshsim.builders import verl as plain

        root, ulysses = plain.fsdp_engine_meshes(world_size, config)
        if ulysses is not None:
            data_rank, data_size = _local(ulysses["dp"])
        else:
            data_rank, data_size = dist.get_rank(), world_size
        strategy = config.get("strategy", "fsdp")
        grad = None if plain.no_shard_clamp(root, strategy) else root
    data = ulysses["dp"] if ulysses is not None else _flat(root, "meshsim_data")
    cp_rank, cp_size = _local(ulysses["sp"] if ulysses is not None else None)
    return TrainerMeshes(data_rank, data_size, grad, data, None, cp_rank, cp_size, 0, ddp=False)
