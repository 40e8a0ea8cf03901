"""HF transformers: ``DistributedConfig``, ``initialize_distributed_mesh`` and the Trainer's mesh.

Modelled on transformers 5.23.0 (``transformers/distributed/configuration_utils.py``,
``distributed/utils.py``, ``distributed/mixin.py``, ``distributed/fsdp.py``, ``trainer.py``).
``initialize_distributed_mesh`` builds two meshes over the same ranks with ``init_device_mesh``,
size-1 dims kept and nothing flattened: the dense mesh ``(pp, dp_replicate, fsdp, tp)`` and the
expert mesh ``(pp, dp_replicate, efsdp, ep)`` with ``efsdp = fsdp * tp // ep``. Kinds are the
dense mesh's dims and the sub-meshes transformers slices off it (``fsdp_mesh``: what FSDP2
shards over; ``device_mesh``: ``model._device_mesh``), the expert mesh's dims and its FSDP
sub-mesh prefixed ``expert:``, and, when the model is tensor parallel, the mesh the Trainer has
accelerate build (``ParallelismConfig(tp_size=tp, dp_shard_size=dp_replicate * fsdp)``), its
kinds as meshsim's accelerate convention names them, prefixed ``trainer:``.

When every size is 1, ``initialize_distributed_mesh`` returns no mesh at all: every kind is then
unavailable (the config is valid, the model is just not distributed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown, upstream_error
from meshsim.model.conventions._transformers_configs import configs as configs
from meshsim.model.conventions._transformers_configs import refused_configs as refused_configs
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.layout import Layout

PARAMETERS: Final[Mapping[str, str]] = {
    "tp_size": "tensor-parallel size (None: WORLD_SIZE // (dp_replicate*fsdp*pp) when tp_plan "
    "is set, else 1)",
    "tp_plan": "tensor-parallel plan ('auto' or a dict); only whether it is None matters here",
    "fsdp_size": "FSDP2 shard size (None: 1)",
    "dp_replicate_size": "HSDP replicas (None: 1)",
    "pp_size": "pipeline-parallel size (None: 1)",
    "ep_size": "expert-parallel size (None: 1, or tp_size under enable_expert_parallel)",
    "enable_expert_parallel": "deprecated: without ep_size, ep_size = tp_size",
    "ep_plan": "expert-parallel plan: a dict or None (anything else is refused)",
    "fsdp_plan": "FSDP2 plan: a dict or None (anything else is refused)",
    "parallelism_config": "TrainingArguments.parallelism_config, as a dict of accelerate "
    "ParallelismConfig keys (None: the Trainer makes one only for a TP model)",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "ep_plan": "only checked to be a dict or None, then read by the sharding code; no group "
    "depends on it",
    "fsdp_plan": "only checked to be a dict or None, then read by the sharding code; no group "
    "depends on it",
}

DENSE_DIMS: Final = ("pp", "dp_replicate", "fsdp", "tp")
EXPERT_DIMS: Final = ("pp", "dp_replicate", "efsdp", "ep")
_SIZES: Final = ("tp_size", "fsdp_size", "dp_replicate_size", "pp_size", "ep_size")


_value_error = upstream_error("ValueError")

#: Dims of two meshes that are one group by design (``meshsim.check_meshes`` accepts them): the
#: Trainer hands accelerate ``dp_shard_size = dp_size``, which is the model's ``fsdp`` group
#: whenever there are no replicas.
SAME_GROUPS: Final = (("main:fsdp", "trainer:dp_shard"),)


def expect(world_size: int, **config: Any) -> Expected:
    """Every group transformers builds for ``DistributedConfig(**config)`` on ``world_size``.

    Example: ``expect(8, fsdp_size=4, tp_size=2, ep_size=4)`` builds the dense mesh
    (pp, dp_replicate, fsdp, tp) = (1, 1, 4, 2), whose ``tp`` groups are ``(0, 1)``, ``(2, 3)``,
    ... and the expert mesh (1, 1, 2, 4): ``expert:ep`` groups ``(0, 1, 2, 3)``, ``(4, 5, 6,
    7)``, ``expert:efsdp`` groups ``(0, 4)``, ``(1, 5)``, ... The Trainer's accelerate mesh is
    (dp_shard, tp) = (4, 2): ``trainer:tp`` equals ``tp``.
    """
    reject_unknown("transformers", config, PARAMETERS)
    sizes = resolve(world_size, config)
    pp, dp_replicate, fsdp, tp, ep = (
        sizes[k] for k in ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size", "ep_size")
    )
    shape = (pp, dp_replicate, fsdp, tp)
    normal = {k: v for k, v in config.items() if v is not None}
    if shape == (1, 1, 1, 1):
        return _undistributed(world_size, normal)
    if math.prod(shape) != world_size:
        raise LayoutError(
            f"The parallel mesh requires {math.prod(shape)} processes, but world_size is "
            f"{world_size}: initialize_distributed_mesh needs pp_size * dp_replicate_size * "
            f"fsdp_size * tp_size = {pp} * {dp_replicate} * {fsdp} * {tp} = the world size",
            upstream="RuntimeError",
        )
    dense = Layout(list(zip(DENSE_DIMS, shape, strict=True)))
    expert = Layout(list(zip(EXPERT_DIMS, (pp, dp_replicate, fsdp * tp // ep, ep), strict=True)))
    kinds = _mesh_kinds(dense, "", "dense mesh", "fsdp")
    kinds += _mesh_kinds(expert, "expert:", "expert mesh", "efsdp")
    roles = {
        # FSDP2 reduce-scatters over fsdp and all-reduces over dp_replicate on that (sub-)mesh.
        "gradient_reduce": "fsdp_mesh",
    }
    # maybe_distribute_model applies PP, TP and EP (and FSDP2 on efsdp) only for sizes > 1.
    if tp > 1:
        roles["tensor"] = "tp"
    if pp > 1:
        roles["pipeline"] = "pp"
    if ep > 1:
        roles["expert"] = "expert:ep"
        roles["expert_data"] = "expert:fsdp_mesh"
    meshes = {"expert": expert}
    pc = config.get("parallelism_config")
    trainer_kinds, trainer_mesh = _trainer(world_size, tp, dp_replicate * fsdp, pc)
    kinds += trainer_kinds
    if trainer_mesh is not None:
        meshes["trainer"] = trainer_mesh
    if any(k.name == "trainer:dataloader_replica" and k.available for k in trainer_kinds):
        # The Trainer's loader is accelerate's prepare_data_loader: its replica is what decides
        # the batch a rank loads (pp_size=8 at world 8: no mesh, so rank r is index r of 8).
        roles["data_parallel"] = "trainer:dataloader_replica"
    return Expected("transformers", world_size, normal, kinds, roles, layout=dense, meshes=meshes)


def trainer_parallelism(
    tp: int, dp_size: int, pc: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The accelerate config ``Trainer._build_accelerator_args`` hands on (None: no
    ParallelismConfig), or the LayoutError saying why meshsim cannot state its mesh.

    A TP model sets ``tp_size`` and ``dp_shard_size`` on the ParallelismConfig it was given
    after ``__post_init__``, which had already stored the sizes ``build_device_mesh`` reads
    (``_sizes``): the mesh follows the new sizes only where they equal the given ones.
    """
    if pc is not None and not isinstance(pc, Mapping):
        raise LayoutError(
            f"parallelism_config must be a dict of ParallelismConfig keys, got {pc!r}"
        )
    given = dict(pc or {})
    if tp == 1:
        return given or None
    stale = {
        key: (given.get(key) or 1, size)
        for key, size in (("tp_size", tp), ("dp_shard_size", dp_size))
        if pc is not None and (given.get(key) or 1) != size
    }
    if stale:
        said = ", ".join(f"{k}={old} (the Trainer sets {new})" for k, (old, new) in stale.items())
        raise LayoutError(
            f"the Trainer overwrites the given ParallelismConfig's {said} after __post_init__ "
            "stored the sizes build_device_mesh reads, so the mesh is built from the stale "
            "sizes and does not cover the world; meshsim does not state that mesh (give the "
            "model's tp_size and dp_shard_size = dp_replicate_size * fsdp_size)",
            upstream=None,
        )
    return {**given, "tp_size": tp, "dp_shard_size": dp_size}


def resolve(world_size: int, config: Mapping[str, Any]) -> dict[str, int]:
    """``DistributedConfig.__post_init__``: the resolved sizes, or the ValueError it raises.

    ``world_size`` stands in for the ``WORLD_SIZE`` environment variable that ``tp_size=None``
    with a ``tp_plan`` divides. Example: ``resolve(8, {"tp_plan": "auto", "fsdp_size": 2})``
    gives ``tp_size`` 4.
    """
    raw = {key: config.get(key) for key in _SIZES}
    for key, value in raw.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LayoutError(f"{key} must be an integer size or None, got {value!r}")
    for value in raw.values():
        if value is not None and value < 1:
            raise _value_error(f"Parallelism sizes must be >= 1, got {value}.")
    fsdp = raw["fsdp_size"] or 1
    dp_replicate = raw["dp_replicate_size"] or 1
    pp = raw["pp_size"] or 1
    tp = raw["tp_size"]
    if tp is None and config.get("tp_plan") is not None:
        other = dp_replicate * fsdp * pp
        if world_size % other:
            raise _value_error(
                f"WORLD_SIZE ({world_size}) must be divisible by dp_replicate_size * fsdp_size * "
                f"pp_size ({other}) to derive tp_size."
            )
        tp = world_size // other
    tp = tp or 1
    ep = raw["ep_size"]
    if ep is None and config.get("enable_expert_parallel"):
        ep = tp
    ep = ep or 1
    for plan in ("ep_plan", "fsdp_plan"):
        if config.get(plan) is not None and not isinstance(config[plan], dict):
            raise _value_error(f"`{plan}` must be a dictionary or None.")
    if ep > 1:
        if ep % tp:
            raise _value_error(f"`ep_size` must be a multiple of `tp_size` (ep {ep}, tp {tp}).")
        if (fsdp * tp) % ep:
            raise _value_error(
                f"`ep_size` must divide `fsdp_size * tp_size` (ep {ep}, fsdp * tp = {fsdp * tp})."
            )
    if dp_replicate * fsdp > 1 and pp > 1:
        raise _value_error(
            "Combining FSDP with pipeline parallelism is not supported yet "
            f"(dp_replicate_size * fsdp_size = {dp_replicate * fsdp}, pp_size = {pp})."
        )
    return {
        "tp_size": tp,
        "fsdp_size": fsdp,
        "dp_replicate_size": dp_replicate,
        "pp_size": pp,
        "ep_size": ep,
    }


def _fsdp_dims(dp_replicate: int, shard: str) -> tuple[str, ...]:
    """``apply_fully_sharded_data_parallelism``: HSDP's 2-D mesh only when dp_replicate > 1."""
    return ("dp_replicate", shard) if dp_replicate > 1 else (shard,)


def _mesh_kinds(root: Layout, prefix: str, where: str, shard: str) -> list[Kind]:
    call = "_expert_mesh[{!r}]" if prefix else "get_mesh({!r})"
    kinds = [
        layout_kind(root, prefix + dim, f"{where} dim {dim!r} ({call.format(dim)})", dim)
        for dim in root.root_names
    ]
    dims = _fsdp_dims(root.size_of("dp_replicate"), shard)
    kinds.append(
        layout_kind(
            root,
            prefix + "fsdp_mesh",
            f"{where}: get_mesh({dims}), FSDP2's mesh"
            + (" for dispatched experts" if prefix else "")
            + " (apply_fully_sharded_data_parallelism)",
            *dims,
        )
    )
    if not prefix:
        kinds.append(
            layout_kind(
                root,
                "device_mesh",
                "dense mesh: get_mesh(('pp', 'fsdp', 'tp')), model._device_mesh "
                "(maybe_distribute_model)",
                "pp",
                "fsdp",
                "tp",
            )
        )
    return kinds


def _trainer(
    world_size: int, tp: int, dp_size: int, pc: Mapping[str, Any] | None = None
) -> tuple[list[Kind], Layout | None]:
    """The Trainer's hand-off to accelerate, as meshsim's accelerate convention models it (its
    rules are not restated here), kinds re-prefixed ``trainer:``: the ParallelismConfig of
    :func:`trainer_parallelism`. Without one accelerate builds no mesh and only the loader's
    kinds are kept (``prepare_data_loader`` over every process; the model was sharded at load
    time, so accelerate wraps nothing). Accelerate refusing the config (pipeline parallelism
    leaves ``tp * dp_size`` short of the world) makes the trainer kinds unavailable, not the
    config: the model itself loads and runs."""
    from meshsim.model.conventions import accelerate

    try:
        handed = trainer_parallelism(tp, dp_size, pc)
        # transformers shards the model itself at load time; the job is launched without an
        # accelerate FSDP plugin, so the Accelerator is a multi-GPU (DDP-type) one.
        built = accelerate.expect(world_size, **(handed or {}), distributed_type="MULTI_GPU")
    except LayoutError as error:
        what = f"ParallelismConfig({_call_args(pc, tp, dp_size)})"
        refusal = LayoutError(
            f"Trainer hands accelerate {what} and it is not built: {error}",
            upstream=error.upstream,
        )
        return [Kind("trainer:tp", "Trainer's accelerate mesh: not built", refusal)], None
    names = [*built.kinds(), *built.unavailable()]
    if handed is None:
        names = ["dataloader_replica", "dataloader_batch_peers"]
    kinds = [
        dataclasses.replace(
            built.kind(name),
            name="trainer:" + name,
            description="Trainer -> accelerate ParallelismConfig mesh: "
            + built.kind(name).description,
            _cache=[],
        )
        for name in names
    ]
    return kinds, built.layout


def _call_args(pc: Mapping[str, Any] | None, tp: int, dp_size: int) -> str:
    sizes = dict(pc or {}) if isinstance(pc, Mapping) else {}
    if tp > 1:
        sizes.update(tp_size=tp, dp_shard_size=dp_size)
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _undistributed(world_size: int, config: Mapping[str, Any]) -> Expected:
    """Every size 1: ``prepare_distribute_model`` / ``initialize_distributed_mesh`` return no
    mesh, so every kind is unavailable."""
    error = LayoutError(
        "every parallel size is 1: initialize_distributed_mesh returns (None, None) and builds "
        "no mesh",
        upstream=None,
    )
    names = [*DENSE_DIMS, "fsdp_mesh", "device_mesh"] + [
        "expert:" + n for n in (*EXPERT_DIMS, "fsdp_mesh")
    ]
    kinds = [Kind(name, "not built", error) for name in names]
    return Expected("transformers", world_size, config, kinds, {})
