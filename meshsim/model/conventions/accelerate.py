"""HF accelerate: ``ParallelismConfig.build_device_mesh`` and what ``Accelerator`` does with it.

Modelled on accelerate 1.15.0 (``version="1.15"``, the default) and 1.10.0 (``version="1.10"``):
``parallelism_config.py`` (``__post_init__``, ``_get_mesh``, ``build_device_mesh``,
``_validate_accelerator``), ``accelerator.py`` (``__init__`` builds the mesh *before* validating
it; ``_prepare_deepspeed``'s AutoTP mesh; ``_prepare_device_mesh``), ``data_loader.py``
(``prepare_data_loader``'s replica arithmetic) and ``utils/fsdp_utils.py`` (``fully_shard``'s mesh).

The mesh is ``init_device_mesh`` over the dims of size > 1 only, in the order ``dp_replicate,
dp_shard, cp, (sp,) tp``, then ``_flatten`` s ``dp`` (dp_replicate, dp_shard), ``dp_shard_cp``
(dp_shard, cp) and ``dp_cp`` (dp_replicate, dp_shard, cp), each only when one of its dims is kept.
A name the code never creates under a config is an unavailable kind with the ``KeyError`` torch
raises for ``mesh[name]`` (accelerate#3798: a TP-only mesh has no ``dp_shard_cp``, which
``fully_shard`` asks for); with no mesh at all (every size 1, or 1.15's DeepSpeed ``sp_size > 1``)
``Accelerator.torch_device_mesh`` is None and indexing it is a ``TypeError``.

The data loader never reads its replica from the mesh: ``prepare_data_loader`` divides the
process index by the ``tp`` x ``cp`` dim sizes (DeepSpeed: by ``tp`` only). ``dataloader_replica``
(the ``data_parallel`` role) is that arithmetic's DP group, so it can be compared with the mesh's
``dp``; ``dataloader_batch_peers`` are the ranks the arithmetic hands the same batches. With
``dispatch_batches`` the ``DataLoaderDispatcher`` decides instead (one batch for all once the
mesh has ``tp``). ``gradient_reduce`` is ``fsdp_mesh`` (FSDP2's ``mesh[fsdp_dim_names]``) or
``ddp`` (the world group). ``MULTI_GPU`` with ``tp_size > 1`` has neither: ``prepare_model``
wraps in DDP only when the config has no TP, so data-parallel replicas there never reduce
(docs/findings.md). DeepSpeed reduces over its own groups (the deepspeed convention), which
this reference leaves unknown (``Expected.unknown_roles``), as it does where accelerate raises
before building the FSDP mesh (accelerate#3798).
DeepSpeed AutoTP adds ``ds:tp``, accelerate's ``("tp",)`` mesh on ranks ``0..autotp_size-1`` only,
which the loader then divides by; DeepSpeed Ulysses (1.15, ``sp_size > 1``) adds ``ds:sp`` and
``ds:sp_dp``, the groups of DeepSpeed's ``parallel_state_sp`` that ``_prepare_deepspeed`` sets up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions import _accelerate_configs, check, reject_unknown
from meshsim.model.conventions._accelerate_configs import refused_configs as refused_configs
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout

PARAMETERS: Final[Mapping[str, str]] = {
    "dp_replicate_size": "ParallelismConfig.dp_replicate_size (None: 1; env defaults not read)",
    "dp_shard_size": "ParallelismConfig.dp_shard_size (None: 1)",
    "tp_size": "ParallelismConfig.tp_size (None: 1)",
    "cp_size": "ParallelismConfig.cp_size (None: 1)",
    "sp_size": "ParallelismConfig.sp_size, DeepSpeed ALST/Ulysses (1.15 only; None: 1)",
    "cp_backend": "ParallelismConfig.cp_backend (1.15 only; None: 'torch', the one backend "
    "accepted; groups and loaders are the same)",
    "sp_backend": "ParallelismConfig.sp_backend (1.15 only; None: 'deepspeed', the one backend "
    "accepted: with sp_size > 1 it is why build_device_mesh builds no mesh)",
    "version": "accelerate release modelled: '1.15' (default) or '1.10'",
    "distributed_type": "Accelerator's DistributedType: 'FSDP' (FSDP2 plugin), 'MULTI_GPU' (DDP) "
    "or 'DEEPSPEED' (None: FSDP when dp_shard/cp > 1, DEEPSPEED when sp/autotp > 1, "
    "else MULTI_GPU)",
    "dispatch_batches": "DataLoaderConfiguration.dispatch_batches: rank 0 loads and dispatches "
    "(None/False: each rank loads its own shard, as for a map-style dataset)",
    "autotp_size": "DeepSpeed plugin config tensor_parallel.autotp_size: _prepare_deepspeed's 1-D "
    "('tp',) mesh (DEEPSPEED only; None/0/1: none)",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "cp_backend": "accelerate accepts one value, 'torch', the default",
    "sp_backend": "accelerate accepts one value, 'deepspeed', the default",
}

VERSIONS: Final = ("1.15", "1.10")
#: Spellings of each version: ``--version 1.10`` on the command line arrives as the float 1.1.
_VERSION_SPELLINGS: Final[Mapping[object, str]] = {
    **{spelling: v for v in VERSIONS for spelling in (v, f"{v}.0")},
    1.15: "1.15",
    1.1: "1.10",
}
DISTRIBUTED_TYPES: Final = ("FSDP", "MULTI_GPU", "DEEPSPEED")
#: ``_get_mesh``'s canonical order (1.10 has no ``sp``).
MESH_ORDER: Final = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
#: ``build_device_mesh``'s flattens, in its order: name -> the dims it joins when kept.
FLATTENS: Final[Mapping[str, tuple[str, ...]]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
_SIZES: Final = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
#: ``__post_init__``'s one accepted value of each backend key (its default).
BACKENDS: Final[Mapping[str, str]] = {"cp_backend": "torch", "sp_backend": "deepspeed"}


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every ``(dp_replicate, dp_shard, cp, tp)`` split of the world (sizes of 1 left out) that
    accelerate accepts, under the default distributed type and under each other one, in 1.15 and
    (``versions=`` to restrict) 1.10; then DeepSpeed ``sp_size`` and AutoTP ``autotp_size`` for
    every divisor, and ``dispatch_batches`` with FSDP x TP and FSDP x CP splits. World 8 gives
    50 configs; :func:`refused_configs` lists rejected ones."""
    return _accelerate_configs.configs(world_size, expect, DISTRIBUTED_TYPES, **options)


def expect(world_size: int, **config: Any) -> Expected:
    """Every group accelerate builds for ``ParallelismConfig(**sizes)`` on ``world_size`` ranks.

    Example: ``expect(8, dp_shard_size=2, cp_size=2, tp_size=2)`` keeps (dp_shard, cp, tp) =
    (2, 2, 2); ``groups("tp")`` is ``[(0, 1), (2, 3), (4, 5), (6, 7)]``, ``groups("dp_shard_cp")``
    ``[(0, 2, 4, 6), (1, 3, 5, 7)]`` and the loader's ``dataloader_replica`` (``rank // 4``)
    ``[(0, 4), (1, 5), (2, 6), (3, 7)]``, the mesh's ``dp``.
    """
    reject_unknown("accelerate", config, PARAMETERS)
    cfg = validate(world_size, config)
    dims = _mesh_dims(cfg)
    root = None if dims is None else Layout(dims)
    kinds = _mesh_kinds(root)
    if cfg["distributed_type"] == "FSDP":
        kinds["fsdp_mesh"] = _fsdp_kind(world_size, root)
    elif cfg["distributed_type"] == "MULTI_GPU" and cfg["tp_size"] == 1:
        kinds["ddp"] = Kind(
            "ddp",
            "DistributedDataParallel(model): the default (world) group",
            lambda: Groups([tuple(range(world_size))]),
        )
    ds_tp = (cfg["autotp_size"] or 0) if cfg["distributed_type"] == "DEEPSPEED" else 0
    if ds_tp > 1:
        kinds["ds:tp"] = Kind(
            "ds:tp",
            "_prepare_deepspeed: init_device_mesh(device, (autotp_size,), ('tp',)), ranks "
            "0..autotp_size-1 only",
            lambda: Groups([tuple(range(ds_tp))]),
            partition=ds_tp == world_size,
        )
    kinds.update(_ulysses_kinds(world_size, cfg))
    block = _loader_block(world_size, cfg, root, ds_tp)
    if not cfg["dispatch_batches"]:
        how = f"prepare_data_loader: process_index // {block}"
    elif block > 1:
        how = "DataLoaderDispatcher: the mesh has tp, so rank 0's one batch goes to every rank"
    else:
        how = "DataLoaderDispatcher: rank 0 loads a batch per rank, rank i keeps slice i"
    loader = Layout([("replica", world_size // block), ("block", block)])
    kinds["dataloader_replica"] = layout_kind(
        loader, "dataloader_replica", f"{how}; ranks that load different batches", "replica"
    )
    kinds["dataloader_batch_peers"] = layout_kind(
        loader, "dataloader_batch_peers", f"{how}; ranks that load the same batches", "block"
    )
    roles = _roles(kinds)
    unknown = _unknown_roles(cfg, kinds)
    normal = {k: v for k, v in cfg.items() if v is not None}
    return Expected(
        "accelerate", world_size, normal, kinds.values(), roles, layout=root, unknown_roles=unknown
    )


def validate(world_size: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """accelerate's checks of ``config``, in its order: ``ParallelismConfig.__post_init__``,
    ``AcceleratorState``'s CP check, ``init_device_mesh``'s size check,
    ``_validate_accelerator`` and ``_prepare_deepspeed``'s AutoTP mesh.

    Returns the config with every key present, ``version`` spelled ``"1.15"``/``"1.10"``, sizes
    of None as 1 and ``distributed_type`` resolved: world 8, ``tp_size=2, dp_shard_size=4``
    gives ``distributed_type`` ``"FSDP"``. Raises the LayoutError naming accelerate's exception.
    """
    cfg = normalize(config)
    check_config(world_size, cfg)
    return cfg


def check_config(world_size: int, cfg: Mapping[str, Any]) -> None:
    """:func:`validate`'s checks of a config :func:`normalize` made (or the same keys)."""
    _validate_config(cfg)
    dims = _mesh_dims(cfg)
    total = math.prod(cfg[k] for k in _SIZES)
    if dims is not None and total > world_size:
        raise LayoutError(
            f"ParallelismConfig total_size {total} > world size {world_size}: "
            f"init_device_mesh refuses the {tuple(n for n, _ in dims)} = "
            f"{tuple(s for _, s in dims)} mesh (Mesh should not be bigger than default world size)",
            upstream="RuntimeError",
        )
    _validate_accelerator(world_size, cfg, total)
    _validate_autotp(world_size, cfg)
    _validate_ulysses(world_size, cfg)


def _mesh_dims(cfg: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """``build_device_mesh``'s kept dims; None when it builds no mesh (every size 1, or
    DeepSpeed SP in 1.15, which makes its own groups)."""
    dims = [(d, cfg[f"{d}_size"]) for d in MESH_ORDER if cfg[f"{d}_size"] > 1]
    if not dims or (cfg["version"] == "1.15" and cfg["sp_size"] > 1):
        return None
    return dims


def version_of(config: Mapping[str, Any]) -> str:
    """The release ``config`` models, ``"1.15"`` or ``"1.10"`` (``1.1`` and ``"1.10.0"`` too)."""
    version = _VERSION_SPELLINGS.get(config.get("version") or "1.15")
    if version is None:
        raise LayoutError(f"version must be one of {VERSIONS}, got {config['version']!r}")
    return version


def normalize(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every key present, ``version`` spelled ``"1.15"``/``"1.10"``, sizes of None as 1 and
    ``distributed_type`` resolved; raises for values accelerate cannot take (wrong types,
    ``sp_size`` in 1.10, ``autotp_size`` outside DeepSpeed). No check against the world."""
    cfg = {key: config.get(key) for key in PARAMETERS}
    cfg["version"] = version_of(config)
    for key in ("sp_size", *BACKENDS):
        if cfg["version"] == "1.10" and cfg[key] is not None:
            raise LayoutError(
                f"accelerate 1.10's ParallelismConfig.__init__() got an unexpected keyword "
                f"argument '{key}' (it came in a later release)",
                upstream="TypeError",
            )
    for key in (*_SIZES, "autotp_size"):
        value = cfg[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LayoutError(f"{key} must be an integer or None, got {value!r}")
    for key in _SIZES:
        cfg[key] = 1 if cfg[key] is None else cfg[key]
    if cfg["dispatch_batches"] is not None and not isinstance(cfg["dispatch_batches"], bool):
        raise LayoutError(f"dispatch_batches must be a bool, got {cfg['dispatch_batches']!r}")
    kind = cfg["distributed_type"]
    if kind is not None and kind not in DISTRIBUTED_TYPES:
        raise LayoutError(f"distributed_type must be one of {DISTRIBUTED_TYPES}, got {kind!r}")
    autotp = cfg["autotp_size"] or 0
    if kind is None:
        if cfg["dp_shard_size"] > 1 or cfg["cp_size"] > 1:
            kind = "FSDP"
        elif cfg["sp_size"] > 1 or autotp > 1:
            kind = "DEEPSPEED"
        else:
            kind = "MULTI_GPU"
    if cfg["autotp_size"] is not None and kind != "DEEPSPEED":
        raise LayoutError(
            f"autotp_size is a DeepSpeed config key; distributed_type {kind!r} never reads it"
        )
    cfg["distributed_type"] = kind
    return cfg


def _validate_config(cfg: Mapping[str, Any]) -> None:
    """``ParallelismConfig.__post_init__`` and ``AcceleratorState``'s CP check, in their order."""
    names = _SIZES if cfg["version"] == "1.15" else _SIZES[:4]
    for key in names:
        if cfg[key] < 1:
            raise LayoutError(
                f"{key} must be at least 1, but got {cfg[key]}", upstream="ValueError"
            )
        backend = {"cp_size": "cp_backend", "sp_size": "sp_backend"}.get(key)
        if backend and cfg[backend] not in (None, BACKENDS[backend]):
            raise LayoutError(
                f"{backend} must be one of [{BACKENDS[backend]!r}], but got {cfg[backend]}",
                upstream="ValueError",
            )
    if cfg["cp_size"] > 1 and cfg["sp_size"] > 1:
        raise LayoutError(
            "Context Parallelism (CP) and Sequence Parallelism (SP) are mutually exclusive",
            upstream="ValueError",
        )
    if (
        (cfg["tp_size"] > 1 or cfg["cp_size"] > 1)
        and cfg["dp_replicate_size"] > 1
        and cfg["dp_shard_size"] == 1
    ):
        raise LayoutError(
            "Tensor/Context parallelism (tp/cp_size > 1) cannot be used with pure data "
            "parallelism (dp_replicate_size > 1 and dp_shard_size == 1)",
            upstream="ValueError",
        )
    if cfg["cp_size"] > 1 and cfg["distributed_type"] == "MULTI_GPU":
        raise LayoutError(
            "`cp_size > 1` specified in the `parallelism_config`, but no `fsdp_plugin` was "
            "provided (AcceleratorState: CP needs FSDP2)",
            upstream="ValueError",
        )


def _validate_accelerator(world_size: int, cfg: Mapping[str, Any], total: int) -> None:
    """``ParallelismConfig._validate_accelerator``, run after the mesh is built."""
    kind, v115 = cfg["distributed_type"], cfg["version"] == "1.15"
    multi_device = kind == "MULTI_GPU" and world_size > 1
    if not multi_device and total == 1:
        return
    if total == 1:
        total = world_size  # _set_size("dp_replicate", num_processes), after the mesh (None)
    if not (v115 and cfg["sp_size"] > 1) and total != world_size:
        raise LayoutError(
            f"ParallelismConfig total_size ({total}) does not match num_processes ({world_size})",
            upstream="ValueError",
        )
    if v115 and kind == "FSDP" and cfg["dp_shard_size"] == 1 and cfg["cp_size"] == 1:
        raise LayoutError(
            "FSDP is enabled but the parallelism config has no dimension for FSDP to shard "
            "across (both `dp_shard_size` and `cp_size` are 1)",
            upstream="ValueError",
        )
    allowed = ("FSDP", "MULTI_GPU", "DEEPSPEED") if v115 else ("FSDP", "MULTI_GPU")
    if total > 1 and kind not in allowed:
        raise LayoutError(
            f"ParallelismConfig (total_size {total}) is only compatible with "
            f"{' / '.join(allowed)} in accelerate {cfg['version']}, got DistributedType.{kind}",
            upstream="ValueError",
        )


def ulysses_size(cfg: Mapping[str, Any]) -> int:
    """The DeepSpeed ALST/Ulysses degree ``_prepare_deepspeed`` hands DeepSpeed's mpu (1.15,
    DeepSpeed, ``sp_size > 1``); 1 where it builds no sequence-parallel groups."""
    v115, deepspeed = cfg["version"] == "1.15", cfg["distributed_type"] == "DEEPSPEED"
    return cfg["sp_size"] if v115 and deepspeed and cfg["sp_size"] > 1 else 1


def _validate_ulysses(world_size: int, cfg: Mapping[str, Any]) -> None:
    """DeepSpeed's ``initialize_sequence_parallel``, which ``register_with_transformers`` calls
    from ``_prepare_deepspeed``: ParallelismConfig itself checks nothing of ``sp_size``."""
    sp = ulysses_size(cfg)
    where = "(DeepSpeed's initialize_sequence_parallel, from _prepare_deepspeed)"
    check(
        sp <= world_size,
        f"world_size ({world_size}) is less than sequence_parallel_size {sp} {where}",
        "RuntimeError",
    )
    check(
        world_size % sp == 0,
        f"world_size ({world_size}) is not divisible by sequence_parallel_size {sp} {where}",
        "RuntimeError",
    )


def _ulysses_kinds(world_size: int, cfg: Mapping[str, Any]) -> dict[str, Kind]:
    """DeepSpeed's Ulysses groups (``parallel_state_sp``): ``sp_size`` consecutive ranks, and
    one sequence-data-parallel group of the whole world. The loader still splits batches over
    every rank (``dataloader_replica``); ``UlyssesSPDataLoaderAdapter`` then all-gathers them
    within ``ds:sp`` and hands each peer a sequence chunk of every peer's batch."""
    sp = ulysses_size(cfg)
    if sp == 1:
        return {}
    ulysses = Layout([("sp_dp", world_size // sp), ("sp", sp)])
    return {
        "ds:sp": layout_kind(
            ulysses,
            "ds:sp",
            "parallel_state_sp.get_sequence_parallel_group(): sp_size consecutive ranks "
            "(the mpu _prepare_deepspeed passes on; UlyssesSPDataLoaderAdapter's sp_group)",
            "sp",
        ),
        "ds:sp_dp": Kind(
            "ds:sp_dp",
            "parallel_state_sp.get_sequence_data_parallel_group(): every rank (sp x dp)",
            lambda: Groups([tuple(range(world_size))]),
        ),
    }


def _validate_autotp(world_size: int, cfg: Mapping[str, Any]) -> None:
    """``_prepare_deepspeed``'s ``init_device_mesh(device, (autotp_size,), ("tp",))``."""
    autotp = cfg["autotp_size"] or 0
    if autotp > world_size:
        raise LayoutError(
            f"autotp_size {autotp} > world size {world_size}: _prepare_deepspeed's "
            "init_device_mesh refuses the ('tp',) mesh",
            upstream="RuntimeError",
        )
    if autotp > 1 and world_size % autotp:
        inside = world_size // autotp * autotp
        raise LayoutError(
            f"autotp_size {autotp} does not divide the world {world_size}: accelerate builds "
            f"its ('tp',) mesh, but DeepSpeed's engine (_init_tp_mesh_device) lays a "
            f"({world_size // autotp}, {autotp}) ('data_parallel', 'tensor_parallel') mesh over "
            f"ranks 0-{inside - 1}, and get_group raises IndexError on ranks {inside}-"
            f"{world_size - 1}, outside it",
            upstream="IndexError",
        )


def _mesh_kinds(root: Layout | None) -> dict[str, Kind]:
    """Every dim and flattened name, available or with the error asking for it raises."""
    kinds: dict[str, Kind] = {}
    if root is None:
        error = LayoutError(
            "no device mesh: build_device_mesh returned None (every size 1, or DeepSpeed "
            "sp_size > 1), so accelerator.torch_device_mesh[...] is 'NoneType' object is not "
            "subscriptable",
            upstream="TypeError",
        )
        for name in (*MESH_ORDER, *FLATTENS):
            kinds[name] = Kind(name, "not built: no device mesh", error)
        return kinds
    kept = root.root_names
    for dim in MESH_ORDER:
        if dim in kept:
            kinds[dim] = layout_kind(root, dim, f"build_device_mesh: mesh dim {dim!r}", dim)
        else:
            kinds[dim] = Kind(dim, f"mesh dim {dim!r}: size 1, dropped", _missing(dim, kept))
    for name, dims in FLATTENS.items():
        present = tuple(d for d in dims if d in kept)
        if present:
            description = f"build_device_mesh: mesh[{list(present)}]._flatten({name!r})"
            kinds[name] = layout_kind(root, name, description, *present)
        else:
            kinds[name] = Kind(name, f"{name!r}: none of {dims} kept", _missing(name, kept))
    return kinds


def _missing(name: str, kept: tuple[str, ...]) -> LayoutError:
    return LayoutError(
        f"Invalid mesh_dim_names ({name!r},) specified: accelerate's mesh has dims {kept} and "
        "never creates that name under this config",
        upstream="KeyError",
    )


def _fsdp_kind(world_size: int, root: Layout | None) -> Kind:
    """``fsdp2_prepare_model``: ``fully_shard(mesh=mesh[fsdp_dim_names])``, fsdp_dim_names =
    (dp_replicate if kept, dp_shard_cp); with no mesh, ``mesh=None``: torch's world mesh."""
    name, what = "fsdp_mesh", "fully_shard's mesh"
    if root is None:
        return Kind(
            name,
            f"{what}: None, torch's default 1-D world mesh",
            lambda: Groups([tuple(range(world_size))]),
        )
    kept = root.root_names
    shard = tuple(d for d in ("dp_shard", "cp") if d in kept)
    if not shard:
        return Kind(name, f"{what}: mesh[('dp_shard_cp',)]", _missing("dp_shard_cp", kept))
    dims = (("dp_replicate",) if "dp_replicate" in kept else ()) + shard
    shard_size = math.prod(root.size_of(d) for d in shard)
    if "dp_replicate" in kept:
        names, shape = ("dp_replicate", "dp_shard_cp"), (root.size_of("dp_replicate"), shard_size)
    else:
        names, shape = ("dp_shard_cp",), (shard_size,)
    return Kind(
        name,
        f"{what}: mesh[{names}]",
        lambda: root.groups(*dims),
        mesh_dims=names,
        mesh_shape=shape,
    )


def _loader_block(world_size: int, cfg: Mapping[str, Any], root: Layout | None, ds_tp: int) -> int:
    """How many consecutive ranks load the same batches, for ``_prepare_device_mesh``'s mesh:
    the DeepSpeed AutoTP mesh if built, else the ParallelismConfig mesh (None: no mesh).

    ``prepare_data_loader`` divides the process index by the mesh's tp x cp sizes (DeepSpeed:
    tp only). ``DataLoaderDispatcher`` (``dispatch_batches``) instead hands every rank the same
    batch when the mesh has a ``tp`` dim, else each rank its own slice, cp or not; its guard
    against TP + DP looks for dims named ``dp``/``fsdp``, which accelerate's meshes never have.
    """
    if ds_tp > 1:
        sizes = {"tp": ds_tp}
    elif root is None:
        return 1
    else:
        sizes = dict(zip(root.root_names, root.root_shape, strict=True))
    if cfg["dispatch_batches"]:
        return world_size if "tp" in sizes else 1
    if cfg["distributed_type"] == "DEEPSPEED":
        return sizes.get("tp", 1)  # "Only considers dp and tp": cp is ignored
    return sizes.get("tp", 1) * sizes.get("cp", 1)


def _unknown_roles(cfg: Mapping[str, Any], kinds: Mapping[str, Kind]) -> dict[str, str]:
    """The gradient role where accelerate hands gradients to someone this reference does not
    model: DeepSpeed's engine, or FSDP2's wrapper that raises before reducing anything."""
    if cfg["distributed_type"] == "DEEPSPEED":
        return {
            "gradient_reduce": (
                "DeepSpeed's engine reduces gradients over its own sequence-data-parallel group "
                "(deepspeed.utils.groups: the world, AutoTP's data_parallel mesh dim or the "
                "Ulysses sp x dp group), which accelerate never builds: meshsim's deepspeed "
                "convention models it, the accelerate reference does not"
            )
        }
    if "fsdp_mesh" in kinds and not kinds["fsdp_mesh"].available:
        return {
            "gradient_reduce": (
                "fully_shard asks for mesh[('dp_shard_cp',)], which this mesh lacks: accelerate "
                "raises KeyError while preparing the model (accelerate#3798), so no gradient "
                "group is ever built"
            )
        }
    return {}


def _roles(kinds: Mapping[str, Kind]) -> dict[str, str]:
    roles = {"data_parallel": "dataloader_replica"}
    for kind in ("fsdp_mesh", "ddp"):
        if kind in kinds and kinds[kind].available:
            roles["gradient_reduce"] = kind
    for role, kind in (("tensor", "tp"), ("context", "cp")):
        if kinds[kind].available:
            roles[role] = kind
    return roles
