"""verl: the FSDP engine's meshes, the Ulysses mesh, the dispatch rule, and the torchtitan engine.

Modelled on verl 0.9.1. ``strategy`` picks the engine (``EngineConfig.strategy``):

* ``"fsdp"`` (FSDP1, verl's default) and ``"fsdp2"``: ``FSDPEngine._init_device_mesh`` calls
  ``create_device_mesh(world, fsdp_size)`` (``verl/workers/engine/fsdp/utils.py``): a 1-D
  ``("fsdp",)`` mesh when ``fsdp_size`` is negative or at least the world, else ``("ddp",
  "fsdp") = (world // fsdp_size, fsdp_size)``. With ``ulysses_sequence_parallel_size`` = sp > 1
  it also builds a separate ``("dp", "sp") = (world // sp, sp)`` mesh (``Expected.meshes
  ["ulysses"]``). The data-parallel rank is that mesh's ``dp`` coordinate (the global rank
  without Ulysses), results come from ``sp`` rank 0.
* ``"torchtitan"``: ``TorchtitanEngine._init_device_mesh`` hands the sizes to torchtitan's
  ``ParallelDims`` (modelled by meshsim's torchtitan convention, torchtitan 0.3.0's
  ``spmd_types`` backend, which verl leaves at its default). The data-parallel rank is the
  ``loss`` mesh's local rank (``batch`` x ``cp``), the data-parallel size
  ``data_parallel_shard_size * data_parallel_replicate_size``; results come from tp rank 0,
  the last pp rank and cp rank 0.

``_register_dispatch_collect_info("train", dp_rank, is_collect)`` (``engine_workers.py``) is what
the single controller splits batches by: chunk i of ``max(dp_rank) + 1`` goes to every worker
whose ``dp_rank`` is i (kind ``dispatch``: the workers sharing a chunk), and outputs are
concatenated from the collecting workers in global-rank order (kind ``collect``, one group,
``partition=False``).

Gradient reduction (kind ``fsdp_reduce``) follows torch: FSDP2 and FSDP1's FULL_SHARD /
HYBRID_SHARD reduce over the whole FSDP mesh, but FSDP1 clamps HYBRID_SHARD to NO_SHARD when
its shard group has one rank (``fsdp_size=1``) and then reduces over that one rank only
(known and declined upstream: verl#7493 and PR #7494 were closed, ``fsdp_size=1`` not being an
expected size; ``get_sharding_strategy`` still picks HYBRID_SHARD). The torchtitan engine's
data rank is the ``loss`` mesh's (``batch`` x ``cp``) while its data size is the batch alone
(unreported upstream; docs/findings.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import reject_unknown
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations, spread

__all__ = ["PARAMETERS", "configs", "expect", "refused_configs"]

PARAMETERS: Final[Mapping[str, str]] = {
    "strategy": "engine: 'fsdp' (FSDP1, default), 'fsdp2' or 'torchtitan'",
    "fsdp_size": "FSDPEngineConfig.fsdp_size (default -1: one shard group of the whole world)",
    "ulysses_sequence_parallel_size": "FSDPEngineConfig.ulysses_sequence_parallel_size "
    "(default 1: no Ulysses mesh)",
    "data_parallel_replicate_size": "TorchtitanEngineConfig (default 1)",
    "data_parallel_shard_size": "TorchtitanEngineConfig (default 1; -1: the rest of the world)",
    "tensor_parallel_size": "TorchtitanEngineConfig (default 1)",
    "context_parallel_size": "TorchtitanEngineConfig (default 1)",
    "pipeline_parallel_size": "TorchtitanEngineConfig (default 1)",
    "expert_parallel_size": "TorchtitanEngineConfig (default 1)",
}

STRATEGIES: Final = ("fsdp", "fsdp2", "torchtitan")
FSDP_KEYS: Final = ("fsdp_size", "ulysses_sequence_parallel_size")
#: verl's TorchtitanEngineConfig name -> meshsim's torchtitan convention key (ParallelDims).
TITAN_KEYS: Final[Mapping[str, str]] = {
    "data_parallel_replicate_size": "dp_replicate",
    "data_parallel_shard_size": "dp_shard",
    "context_parallel_size": "cp",
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "expert_parallel_size": "ep",
}
#: torchtitan kinds the verl torchtitan engine reads or hands to FSDP.
TITAN_KINDS: Final = ("pp", "batch", "loss", "dp_replicate", "dp_shard", "cp", "tp", "ep")

_DISPATCH: Final = "dispatch"
_COLLECT: Final = "collect"
_DATA: Final = "get_data_parallel_group"
_REPLICATE_2: Final[Mapping[str, int]] = {"data_parallel_replicate_size": 2}


def expect(world_size: int, **config: Any) -> Expected:
    """Every group verl builds or dispatches by for ``config`` on ``world_size`` ranks.

    Example: ``expect(8, fsdp_size=4, ulysses_sequence_parallel_size=2)`` has an FSDP mesh
    ``(ddp, fsdp) = (2, 4)`` with ``fsdp`` groups ``(0, 1, 2, 3)``, ``(4, 5, 6, 7)``, a Ulysses
    mesh ``(dp, sp) = (4, 2)`` with ``sp`` groups ``(0, 1)``, ``(2, 3)``, ..., and
    ``get_data_parallel_group`` (the Ulysses ``dp`` dim) ``(0, 2, 4, 6)``, ``(1, 3, 5, 7)``.
    """
    reject_unknown("verl", config, PARAMETERS)
    strategy = config.get("strategy", "fsdp")
    if strategy not in STRATEGIES:
        raise LayoutError(
            f"strategy must be one of {STRATEGIES} (meshsim models verl's FSDP and torchtitan "
            f"engines), got {strategy!r}"
        )
    own, other = (TITAN_KEYS, FSDP_KEYS) if strategy == "torchtitan" else (FSDP_KEYS, TITAN_KEYS)
    foreign = sorted(k for k in config if k in other)
    if foreign:
        raise LayoutError(
            f"{foreign} belong to another engine's config than strategy={strategy!r}, whose "
            f"keys are {list(own)}"
        )
    for key in (*FSDP_KEYS, *TITAN_KEYS):
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{key} must be an integer, got {value!r}")
    if strategy == "torchtitan":
        return _torchtitan(world_size, config)
    return _fsdp(world_size, strategy, config)


# -- FSDP engine ------------------------------------------------------------------------------


def fsdp_mesh(world_size: int, fsdp_size: int) -> Layout:
    """``create_device_mesh``: 1-D over the world, or (ddp, fsdp) when 0 < fsdp_size < world."""
    if fsdp_size < 0 or fsdp_size >= world_size:
        return Layout([("fsdp", world_size)])
    if fsdp_size == 0:
        raise LayoutError(
            "create_device_mesh computes world_size // fsdp_size: ZeroDivisionError with "
            "fsdp_size=0 (use -1 for one shard group of the whole world)",
            upstream="ZeroDivisionError",
        )
    if world_size % fsdp_size:
        raise _outside(world_size, (world_size // fsdp_size, fsdp_size), "fsdp_size")
    return Layout([("ddp", world_size // fsdp_size), ("fsdp", fsdp_size)])


def ulysses_mesh(world_size: int, sp: int) -> Layout | None:
    """``_init_device_mesh``'s ``(dp, sp)`` mesh (None when sp <= 1: verl builds none)."""
    if sp == 0:
        raise LayoutError(
            "get_data_parallel_size divides the world by ulysses_sequence_parallel_size: "
            "ZeroDivisionError with 0",
            upstream="ZeroDivisionError",
        )
    if sp < 0:
        raise LayoutError(f"ulysses_sequence_parallel_size must be >= 1, got {sp}")
    if sp == 1:
        return None
    if sp > world_size:
        error = _torch_release.empty_mesh_error()
        raise LayoutError(
            f"ulysses_sequence_parallel_size={sp} exceeds the world ({world_size}): verl builds "
            f"a (dp, sp) = (0, {sp}) mesh, which init_device_mesh rejects ({error})",
            upstream=error,
        )
    if world_size % sp:
        raise _outside(world_size, (world_size // sp, sp), "ulysses_sequence_parallel_size")
    return Layout([("dp", world_size // sp), ("sp", sp)])


def _outside(world_size: int, shape: tuple[int, int], key: str) -> LayoutError:
    """A mesh smaller than the world: torch builds it, and the ranks outside fail on first use."""
    size = shape[0] * shape[1]
    outside = f"ranks {size}-{world_size - 1}" if size < world_size - 1 else f"rank {size}"
    return LayoutError(
        f"{key} does not divide the world ({world_size}): verl builds a {shape} mesh of "
        f"{size} ranks, and {outside}, outside it, fail when they first use it (IndexError or "
        f"RuntimeError from DeviceMesh); choose a divisor of {world_size}",
        upstream="IndexError",
    )


def fsdp_reduce(root: Layout, strategy: str) -> Layout:
    """The sub-mesh whose ranks FSDP averages gradients over, as torch decides it.

    FSDP2 (``fully_shard(mesh=...)``): the whole mesh (reduce-scatter over ``fsdp``, all-reduce
    over ``ddp``). FSDP1: ``get_sharding_strategy`` picks FULL_SHARD on a 1-D mesh (group
    ``mesh_dim=0``) and HYBRID_SHARD on a 2-D one (shard group ``fsdp``, inter-node group
    ``ddp``); ``_init_core_state`` then clamps to NO_SHARD when the shard group has one rank,
    and NO_SHARD all-reduces over that one-rank group alone.
    """
    if strategy == "fsdp" and root.ndim == 2 and root.size_of("fsdp") == 1:
        return root["fsdp"]
    return root[root.dim_names]


def _fsdp(world_size: int, strategy: str, config: Mapping[str, Any]) -> Expected:
    fsdp_size = config.get("fsdp_size", -1)
    sp = config.get("ulysses_sequence_parallel_size", 1)
    root = fsdp_mesh(world_size, fsdp_size)
    ulysses = ulysses_mesh(world_size, sp)
    missing_ddp = LayoutError(
        f"Invalid mesh_dim_names ('ddp',) specified. Valid mesh_dim_names are "
        f"{list(root.dim_names)}.",
        upstream="KeyError",
    )
    reduce = fsdp_reduce(root, strategy)
    clamped = reduce.dim_names == ("fsdp",) and root.ndim == 2
    kinds = [
        layout_kind(root, "device_mesh", "create_device_mesh: the mesh FSDP is handed"),
        layout_kind(root, "fsdp", "device_mesh['fsdp']: FSDP's shard group", "fsdp"),
        layout_kind(root, "ddp", "device_mesh['ddp']: HSDP's replicate group", "ddp")
        if "ddp" in root.dim_names
        else Kind("ddp", "device_mesh['ddp']: HSDP's replicate group", missing_ddp),
        layout_kind(
            reduce,
            "fsdp_reduce",
            "ranks FSDP averages gradients over"
            + (" (FSDP1 clamped HYBRID_SHARD to NO_SHARD: verl#7493)" if clamped else ""),
        ),
    ]
    no_mesh = LayoutError(
        "ulysses_device_mesh is None when ulysses_sequence_parallel_size <= 1",
        upstream="TypeError",
    )
    if ulysses is None:
        world = Layout([("world", world_size)])
        kinds += [
            Kind("dp", "ulysses_device_mesh['dp']", no_mesh),
            Kind("sp", "ulysses_device_mesh['sp'] (ulysses_parallel_group)", no_mesh),
            layout_kind(world, _DATA, "get_data_parallel_group: WORLD without Ulysses"),
            Kind(
                _DISPATCH,
                "workers sharing a batch chunk: dp_rank is the global rank without Ulysses",
                lambda: Groups(world.groups_array("world").reshape(-1, 1)),
            ),
        ]
    else:
        kinds += [
            layout_kind(ulysses, "dp", "ulysses_device_mesh['dp']", "dp"),
            layout_kind(ulysses, "sp", "ulysses_device_mesh['sp'] (ulysses_parallel_group)", "sp"),
            layout_kind(ulysses, _DATA, "get_data_parallel_group: ulysses mesh dim 'dp'", "dp"),
            layout_kind(ulysses, _DISPATCH, "workers sharing a batch chunk (same dp rank)", "sp"),
        ]
    kinds.append(_collect_kind(world_size, ulysses))
    roles = {
        "data_parallel": _DATA,
        "loss": _DATA,
        "gradient_reduce": "fsdp_reduce",
    }
    if ulysses is not None:
        roles["context"] = "sp"
    normal = {"strategy": strategy, "fsdp_size": fsdp_size, "ulysses_sequence_parallel_size": sp}
    meshes = {"ulysses": ulysses} if ulysses is not None else {}
    return Expected("verl", world_size, normal, kinds, roles, layout=root, meshes=meshes)


def _collect_kind(world_size: int, ulysses: Layout | None) -> Kind:
    description = "workers whose outputs are collected (is_mp_src_rank_with_outputs), in order"
    if ulysses is None:
        return Kind(_COLLECT, description, lambda: Groups([list(range(world_size))]))
    return Kind(
        _COLLECT, description, lambda: Groups([list(ulysses.filter(sp=0))]), partition=False
    )


# -- torchtitan engine ------------------------------------------------------------------------


def _torchtitan(world_size: int, config: Mapping[str, Any]) -> Expected:
    from meshsim.model.conventions import torchtitan

    degrees = {TITAN_KEYS[k]: config.get(k, 1) for k in TITAN_KEYS}
    titan = torchtitan.expect(world_size, **degrees)  # verl leaves spmd_backend at its default
    sizes = {k: degrees[k] for k in ("pp", "cp", "tp")}
    batch = world_size // (sizes["pp"] * sizes["cp"] * sizes["tp"])
    if batch * sizes["cp"] == 1:
        raise LayoutError(
            "TorchtitanEngine.get_data_parallel_rank asks ParallelDims for the 'loss' mesh, "
            "which is absent at size 1 (batch x cp = 1), then for 'fsdp', which torchtitan "
            "0.3.0's spmd_types backend does not build: ValueError(\"Invalid mesh dim: "
            "'fsdp'\") while the worker registers its dispatch info",
            upstream="ValueError",
        )
    load = Layout([("pp", sizes["pp"]), ("batch", batch), ("cp", sizes["cp"]), ("tp", sizes["tp"])])
    kinds = [titan.kind(name) for name in TITAN_KINDS]
    kinds += [
        layout_kind(
            load.flatten("batch", "cp", name="loss"),
            _DATA,
            "get_data_parallel_group: ParallelDims 'loss' mesh (batch x cp)",
        ),
        layout_kind(load, _DISPATCH, "workers sharing a batch chunk (same loss rank)", "pp", "tp"),
        Kind(
            _COLLECT,
            "workers whose outputs are collected: tp rank 0, last pp rank, cp rank 0",
            lambda: Groups([list(load.filter(pp=sizes["pp"] - 1, cp=0, tp=0))]),
            partition=False,
        ),
    ]
    roles = {"data_parallel": _DATA, "loss": "loss"}
    for role in ("gradient_reduce", "tensor", "context", "pipeline", "expert"):
        if role in titan.roles and titan.roles[role] in TITAN_KINDS:
            roles[role] = titan.roles[role]
    roles.setdefault("gradient_reduce", "loss")
    normal = {"strategy": "torchtitan", **{k: config.get(k, 1) for k in TITAN_KEYS}}
    return Expected("verl", world_size, normal, kinds, roles, layout=load)


# -- sweeps ------------------------------------------------------------------------------------


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """FSDP engine: both strategies x every fsdp_size that changes the mesh (default, each
    proper divisor; 1 is verl#7493) x every Ulysses degree; then the torchtitan engine over
    every (dp_shard, cp, tp, pp) split with dp_shard x cp > 1, HSDP halves of each, and over a
    few of them dp_shard left to inference (-1) and an expert degree
    (``torchtitan=False`` drops those; so does a described torch release without
    ``_unflatten``, below 2.10, on which torchtitan 0.3.0's ParallelDims cannot build). World 8
    gives 32 + 25."""
    for strategy in ("fsdp", "fsdp2"):
        for fsdp_size in (-1, *divisors(world_size)[:-1]):
            for sp in divisors(world_size):
                cfg: dict[str, Any] = {"strategy": strategy} if strategy != "fsdp" else {}
                if fsdp_size != -1:
                    cfg["fsdp_size"] = fsdp_size
                if sp != 1:
                    cfg["ulysses_sequence_parallel_size"] = sp
                yield cfg
    if not options.get("torchtitan", True) or not _torch_release.builds_unflatten():
        return
    listed: list[dict[str, Any]] = []
    for shard, cp, tp, pp in ordered_factorizations(world_size, 4):
        if shard * cp == 1:
            continue
        base = {"strategy": "torchtitan", "data_parallel_shard_size": shard}
        for key, value in (
            ("context_parallel_size", cp),
            ("tensor_parallel_size", tp),
            ("pipeline_parallel_size", pp),
        ):
            if value > 1:
                base[key] = value
        listed.append(base)
        if shard % 2 == 0 and cp == 1 and pp == 1:
            listed.append(
                {**base, "data_parallel_shard_size": shard // 2, "data_parallel_replicate_size": 2}
            )
    yield from listed
    yield from _titan_options(listed)


#: The torchtitan engine's degrees, as verl's config names them.
_TITAN_AXES: Final = (
    "data_parallel_replicate_size",
    "data_parallel_shard_size",
    "context_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


def _titan_options(listed: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Over a few torchtitan-engine layouts (``spread``): ``data_parallel_shard_size=-1``, left
    for torchtitan's ParallelDims to infer, and the smallest ``expert_parallel_size`` > 1 that
    divides dp_shard x cp x tp."""
    for config in spread(listed, _TITAN_AXES):
        yield {**config, "data_parallel_shard_size": -1}
    for config in spread(listed, _TITAN_AXES):
        region = math.prod(config.get(k, 1) for k in _TITAN_AXES[1:4])
        if region > 1:
            yield {**config, "expert_parallel_size": divisors(region)[1]}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs verl refuses on every rank: ``fsdp_size=0`` (ZeroDivisionError), a Ulysses
    degree of 0 (ZeroDivisionError) or above the world (torch's AssertionError), torchtitan
    sizes whose product is not the world (ParallelDims' AssertionError), and a torchtitan
    layout without data or context parallelism (ValueError, see :func:`_torchtitan`)."""
    yield {"fsdp_size": 0}
    yield {"strategy": "fsdp2", "ulysses_sequence_parallel_size": 0}
    yield {"ulysses_sequence_parallel_size": 2 * world_size}
    if not _torch_release.builds_unflatten():
        return  # below torch 2.10 the torchtitan engine refuses every layout alike
    yield {"strategy": "torchtitan", "data_parallel_shard_size": 2 * world_size}
    yield {"strategy": "torchtitan", "tensor_parallel_size": world_size}
