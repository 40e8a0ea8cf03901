"""AReaL 1.0.4's Archon engine mesh: ``ArchonParallelDims`` (``areal/experimental/models/archon``).

A torchtitan-shaped ``ParallelDims`` that keeps every dim, size 1 included: the root is
``(pp, dp_shard, cp, tp)``, or ``(pp, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)`` when ``ep > 1``.
``build_mesh`` then flattens ``dp`` (the dp_shard ranks: data loading, the engine's data-parallel
group), ``dp_shard_cp`` (the ``fully_shard`` mesh), ``dp_cp`` (same ranks, never used by the
engine), ``pp_cp_tp`` (the model-parallel group whose first rank is the data-parallel head) and,
with EP, ``ep`` (``dp_shard_in_ep x cp``, x ``tp`` when ``etp`` is 1) and the 2-D ``ep_tp`` mesh
(when ``etp == tp``). ``get_mesh(name)`` hands out exactly these names. Refusals are
``ValueError`` from ``__post_init__``; ``dp_replicate`` is accepted and ignored (no HSDP yet).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import reject_unknown, upstream_error
from meshsim.model.conventions.areal_fsdp import engine_roles
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations, spread

PARAMETERS: Final[Mapping[str, str]] = {
    "dp_shard": "ArchonParallelDims.dp_shard (default -1: world / (tp x cp x pp))",
    "cp": "ArchonParallelDims.cp (default 1): Ulysses context-parallel degree",
    "tp": "ArchonParallelDims.tp (default 1): tensor-parallel degree",
    "pp": "ArchonParallelDims.pp (default 1): pipeline-parallel degree",
    "ep": "ArchonParallelDims.ep (default 1; > 1 splits dp_shard into dp_shard_mod_ep/_in_ep)",
    "etp": "ArchonParallelDims.etp (default 1): expert TP degree, 1 or tp",
    "dp_replicate": "ArchonParallelDims.dp_replicate (default 1): accepted, never used (no HSDP)",
}

_PURPOSES: Final[Mapping[str, str]] = {
    "pp": "pipeline parallel: stage p2p, grad-norm pp_group",
    "dp_shard": "FSDP shard degree (no EP)",
    "dp_shard_mod_ep": "the experts' fully_shard mesh (apply_fsdp's dp_mod_ep_mesh)",
    "dp_shard_in_ep": "the dp_shard ranks inside one expert-parallel group",
    "cp": "Ulysses context parallel: get_group('cp')",
    "tp": "tensor parallel: the TP plan's mesh, grad-norm tp_group",
    "dp": "data loading and data_parallel_group (loss-weight all-reduce, grad-norm fsdp_group)",
    "dp_shard_cp": "the fully_shard mesh of dense params",
    "dp_cp": "documented 'for loss all-reduce'; ArchonEngine never reads it",
    "pp_cp_tp": "context and model parallel group; its first rank is the data-parallel head",
    "ep": "expert-parallel mesh",
    "ep_tp": "ExpertTensorParallel's 2-D mesh",
}
_INT_KEYS: Final = ("dp_shard", "cp", "tp", "pp", "ep", "etp", "dp_replicate")
_DEFAULTS: Final[Mapping[str, int]] = {"dp_shard": -1, **dict.fromkeys(_INT_KEYS[1:], 1)}


_value_error = upstream_error("ValueError")


def _normalize(world_size: int, config: Mapping[str, Any]) -> dict[str, int]:
    """``ArchonParallelDims.__post_init__``: infer dp_shard, then validate in its order."""
    cfg: dict[str, int] = {}
    for key in _INT_KEYS:
        value = config.get(key, _DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{key} must be an integer, got {value!r}")
        cfg[key] = value
    dp_shard, cp, tp, pp, ep, etp = (cfg[k] for k in _INT_KEYS[:6])
    if dp_shard < 0:
        if tp * cp * pp == 0:
            raise LayoutError(
                f"dp_shard=-1 is inferred as world_size // (tp * cp * pp) with tp={tp}, cp={cp}, "
                f"pp={pp}: integer division by zero",
                upstream="ZeroDivisionError",
            )
        dp_shard = cfg["dp_shard"] = world_size // (tp * cp * pp)
    product = dp_shard * tp * cp * pp
    if product != world_size:
        raise _value_error(
            f"dp_shard * tp * cp * pp must equal world_size, got {dp_shard} * {tp} * {cp} * {pp} "
            f"= {product}, world_size={world_size}"
        )
    if etp not in (1, tp):  # checked even when ep == 1
        raise _value_error(f"etp must be 1 or equal to tp, got etp={etp}, tp={tp}")
    if ep > 1:
        borrowed, what = (cp, "cp") if etp == tp else (cp * tp, "cp * tp")
        mode = "etp=tp" if etp == tp else "etp=1"
        if ep % borrowed != 0:
            raise _value_error(f"When {mode}, ep must be divisible by {what}, got ep={ep}")
        if dp_shard * borrowed % ep != 0:
            raise _value_error(
                f"When {mode}, dp_shard * {what} must be divisible by ep, got "
                f"{dp_shard * borrowed}, ep={ep}"
            )
    if min(pp, dp_shard, cp, tp) < 1:
        raise LayoutError(
            f"init_device_mesh gets a mesh dim < 1: (pp, dp_shard, cp, tp) = "
            f"({pp}, {dp_shard}, {cp}, {tp})",
            upstream=_torch_release.negative_mesh_dim_error(),
        )
    return cfg


def root_layout(cfg: Mapping[str, int]) -> tuple[Layout, dict[str, Layout]]:
    """``build_mesh``'s root mesh, every name it flattens registered in its order, and the 1-D
    mesh each ``_flatten`` returned (AReaL keeps those; torch 2.10-2.12 would refuse slicing a
    non-contiguous one such as ``pp_cp_tp`` back out of the root)."""
    dp_shard, cp, tp, pp, ep, etp = (cfg[k] for k in _INT_KEYS[:6])
    if ep <= 1:
        root = Layout([("pp", pp), ("dp_shard", dp_shard), ("cp", cp), ("tp", tp)])
        dp_dims: tuple[str, ...] = ("dp_shard",)
    else:
        if etp == tp:
            mod_ep, in_ep = dp_shard * cp // ep, ep // cp
        else:
            mod_ep, in_ep = dp_shard * cp * tp // ep, ep // (cp * tp)
        root = Layout(pp=pp, dp_shard_mod_ep=mod_ep, dp_shard_in_ep=in_ep, cp=cp, tp=tp)
        dp_dims = ("dp_shard_mod_ep", "dp_shard_in_ep")
    flat: dict[str, Layout] = {}
    for name, spanned in (
        ("dp", dp_dims),
        ("dp_shard_cp", (*dp_dims, "cp")),
        ("dp_cp", (*dp_dims, "cp")),
        ("pp_cp_tp", ("pp", "cp", "tp")),
    ):
        flat[name] = root[spanned].flatten(name=name)
        root = flat[name].root()
    if ep > 1:
        if etp == tp:
            # cp joins ep only when > 1; a size-1 dim changes no group either way.
            ep_dims: tuple[str, ...] = ("dp_shard_in_ep", "cp") if cp > 1 else ("dp_shard_in_ep",)
        else:
            ep_dims = ("dp_shard_in_ep", "cp", "tp")
        flat["ep"] = root[ep_dims].flatten(name="ep")
        root = flat["ep"].root()
    return root, flat


def expect(world_size: int, **config: Any) -> Expected:
    """Every mesh ``ArchonParallelDims.get_mesh`` hands out for ``config`` on ``world_size`` ranks.

    Example: ``expect(8, cp=2, tp=2)`` infers dp_shard=2 and builds (pp, dp_shard, cp, tp) =
    (1, 2, 2, 2); ``groups("dp")`` is ``[(0, 4), (1, 5), (2, 6), (3, 7)]``,
    ``groups("dp_shard_cp")`` is ``[(0, 2, 4, 6), (1, 3, 5, 7)]`` and ``groups("pp_cp_tp")`` is
    ``[(0, 1, 2, 3), (4, 5, 6, 7)]``.
    """
    reject_unknown("areal-archon", config, PARAMETERS)
    cfg = _normalize(world_size, config)
    root, flat = root_layout(cfg)
    kinds: list[Kind] = [
        layout_kind(root, dim, f"root dim {dim!r}: {_PURPOSES[dim]}", dim)
        for dim in root.root_names
    ]
    for alias, view in flat.items():
        axes = " x ".join(root.aliases[alias])
        kinds.append(layout_kind(view, alias, f"_flatten of {axes}: {_PURPOSES[alias]}"))
    if cfg["ep"] > 1 and cfg["etp"] == cfg["tp"]:
        view = root["ep", "tp"]
        kinds.append(
            Kind(
                "ep_tp",
                f"2-D slice ['ep', 'tp'] (etp == tp): {_PURPOSES['ep_tp']}",
                lambda: view.groups(),
                mesh_dims=("ep", "tp"),
                mesh_shape=view.shape,
            )
        )
    roles = engine_roles(
        # apply_fsdp(dp_shard_cp): dense gradients are reduce-scattered over dp_shard x cp.
        gradient_reduce="dp_shard_cp",
        context="cp",
        pipeline="pp",
        expert_data="dp_shard_mod_ep" if cfg["ep"] > 1 else None,
    )
    return Expected("areal-archon", world_size, cfg, kinds, roles, layout=root)


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (pp, cp, tp) split with dp_shard inferred, then each valid ep for etp 1 and tp;
    then a few of them (:func:`~meshsim.model.sweep.spread`) with ``dp_shard`` given.

    Only keys that differ from the defaults are given. World 8 gives 64 configs.
    """
    listed: list[dict[str, Any]] = []
    for pp, cp, tp, dp_shard in ordered_factorizations(world_size, 4):
        base = {k: v for k, v in (("pp", pp), ("cp", cp), ("tp", tp)) if v > 1}
        listed.append(base)
        for etp in (1, tp) if tp > 1 else (1,):
            borrowed = cp if etp == tp else cp * tp
            for ep in divisors(dp_shard * borrowed)[1:]:
                if ep % borrowed == 0:
                    listed.append({**base, "ep": ep, **({"etp": etp} if etp > 1 else {})})
    yield from listed
    yield {"dp_shard": world_size, "dp_replicate": 2}  # ignored: the same mesh as {}

    # dp_shard given rather than inferred: the branch of __post_init__ that only checks it.
    def inferred(config: Mapping[str, Any]) -> dict[str, Any]:
        shard = world_size // math.prod(config.get(k, 1) for k in ("pp", "cp", "tp"))
        return {"dp_shard": shard, **config}

    for config in spread(listed, ("dp_shard", "pp", "cp", "tp", "ep"), inferred):
        yield inferred(config)


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs ``ArchonParallelDims.__post_init__`` refuses (``ValueError``; ``tp=0`` with an
    inferred dp_shard divides by zero)."""
    yield {"dp_shard": world_size, "tp": 2}  # product != world
    # The inferred dp_shard floors: world // tp * tp falls short of the world.
    yield {"tp": next(d for d in range(2, world_size + 2) if world_size % d)}
    yield {"tp": 0}
    yield {"etp": 2}  # etp must be 1 or tp, even without EP
    for pp, cp, tp, dp_shard in ordered_factorizations(world_size, 4):
        if cp > 1 and tp == 1 and dp_shard > 1:
            yield {"pp": pp, "cp": cp, "ep": cp + 1}  # etp=tp: ep must be a multiple of cp
        if tp > 1 and dp_shard * cp > 1 and pp == 1:
            yield {"cp": cp, "tp": tp, "ep": cp * tp + 1}  # etp=1: ep must be a multiple of cp*tp
    yield {"ep": 2 * world_size}
