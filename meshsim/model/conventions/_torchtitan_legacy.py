"""torchtitan's one-root-mesh conventions: legacy ``ParallelDims`` and the hyper_parallel seed.

Both build a single ``init_device_mesh`` over the dims of degree > 1 and ``_flatten`` aliases on
its root, so every dim and alias is a kind; a name the config does not create is a kind whose
source is the KeyError slicing the root raises. Also holds the degree checks every torchtitan
version shares (torchtitan.py builds on them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release
from meshsim.model.conventions import check
from meshsim.model.expected import Kind, layout_kind
from meshsim.model.layout import Layout


@dataclass(frozen=True)
class Degrees:
    """Parallel degrees after validation, with ``dp_shard`` resolved."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int


def validate_dense(world_size: int, raw: Mapping[str, int], *, with_etp: bool) -> Degrees:
    """``ParallelDims._validate`` up to the world-size check (the same in every torchtitan)."""
    names = ("dp_replicate", "cp", "tp", "pp", "ep") + (("etp",) if with_etp else ())
    for name in names:
        check(
            raw[name] >= 1,
            f"Parallelism degree should be >= 1, except for dp_shard ({name}={raw[name]})",
        )
    dp_replicate, cp, tp, pp = raw["dp_replicate"], raw["cp"], raw["tp"], raw["pp"]
    dp_shard = raw["dp_shard"]
    check(dp_shard == -1 or dp_shard >= 1, f"dp_shard must -1 or >=1. (got {dp_shard})")
    if dp_shard < 0:
        dp_shard = world_size // (dp_replicate * cp * tp * pp)
        check(
            dp_shard >= 1,
            f"dp_shard=-1 resolves to {dp_shard}: dp_replicate * cp * tp * pp = "
            f"{dp_replicate * cp * tp * pp} exceeds the world size {world_size}",
        )
    check(
        dp_replicate * dp_shard * cp * tp * pp == world_size,
        f"Invalid parallel dims: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * "
        f"tp({tp}) * pp({pp}) != WORLD_SIZE({world_size})",
    )
    return Degrees(world_size, dp_replicate, dp_shard, cp, tp, pp, raw["ep"], raw["etp"])


def root_kinds(
    dims: Sequence[tuple[str, int]],
    flattens: Mapping[str, Sequence[str]],
    describe: Mapping[str, str],
) -> tuple[dict[str, Kind], Layout | None]:
    """Kinds of one root mesh, one per name in ``describe`` (name -> description): the dim or
    flattened alias of that name, or the error slicing the root for it raises.

    ``flattens`` maps an alias to the root dims it flattens, in registration order; an alias may
    name an earlier alias (hyper_parallel flattens ``dp`` again into ``loss``).
    """
    if not dims:
        error = LayoutError(
            "every degree is 1, so this torchtitan version builds a mesh with no dims; no group "
            "kind exists (use world_size > 1)",
            upstream="KeyError",
        )
        return {n: Kind(n, d, error) for n, d in describe.items()}, None
    root = Layout(list(dims))
    for alias, spanned in flattens.items():
        if spanned:
            root = root[tuple(spanned)].flatten(name=alias).root()
    kinds: dict[str, Kind] = {}
    for name in describe:
        if name in root.root_names or name in root.aliases:
            try:
                root[name]  # torch 2.10-2.12 refuse a non-contiguous flattened dim here
            except LayoutError as error:
                kinds[name] = Kind(name, describe[name], error)
                continue
            kinds[name] = layout_kind(root, name, describe[name], name)
        else:
            kinds[name] = Kind(name, describe[name], _slice_error(root, name))
    return kinds, root


def _slice_error(root: Layout, name: str) -> LayoutError:
    """The KeyError ``root[name]`` raises for a name the mesh does not hold."""
    try:
        root.__getitem__(name)
    except LayoutError as error:
        return error
    raise AssertionError(f"{name!r} is in {root!r}")  # pragma: no cover


def pick_roles(kinds: Mapping[str, Kind], wanted: Mapping[str, str]) -> dict[str, str]:
    """role -> kind for every wanted kind that this config makes available."""
    return {role: kind for role, kind in wanted.items() if kind in kinds and kinds[kind].available}


# -- legacy (before Dec 2025) -------------------------------------------------------------------
LEGACY_DESCRIPTIONS: Final[Mapping[str, str]] = {
    "pp": "pipeline parallel (PP)",
    "dp_replicate": "DDP / HSDP replicate dim",
    "dp_shard": "FSDP / HSDP shard dim",
    "dp_shard_mod_ep": "dp_shard * cp / ep: FSDP shard dim of expert parameters (kept at size 1)",
    "dp_shard_in_ep": "the part of dp_shard that EP borrows",
    "cp": "context parallel (CP)",
    "tp": "tensor parallel (TP)",
    "dp": "flatten(dp_replicate, dp_shard): data loading",
    "dp_shard_cp": "flatten(dp_shard, cp): FSDP parameter sharding",
    "dp_cp": "flatten(dp_replicate, dp_shard, cp): loss all-reduce",
    "ep": "expert parallel: flatten(dp_shard_in_ep, cp[, tp when etp == 1])",
}
#: The roles every torchtitan version gives the axis of the same name.
AXIS_ROLES: Final = {"tensor": "tp", "context": "cp", "pipeline": "pp", "expert": "ep"}
LEGACY_ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dp",
    "gradient_reduce": "dp_cp",  # HSDP replicates over dp_replicate and shards over dp_shard_cp
    "loss": "dp_cp",
    **AXIS_ROLES,
    "expert_data": "dp_shard_mod_ep",
}


def validate_legacy(d: Degrees) -> None:
    """Legacy ``build_mesh``'s EP checks: etp is 1 or tp, and EP's share of dp_shard is whole."""
    check(d.ep == 1 or d.etp in (1, d.tp), "Currently we only support ETP=TP or ETP=1")
    if d.ep > 1 and d.etp == d.tp:  # EP borrows all of cp and some of dp_shard
        check(
            d.ep % d.cp == 0 and (d.dp_shard * d.cp) % d.ep == 0,
            f"legacy EP with etp == tp needs ep % cp == 0 and (dp_shard * cp) % ep == 0; got "
            f"ep={d.ep}, cp={d.cp}, dp_shard={d.dp_shard}",
        )
    elif d.ep > 1:  # etp == 1: EP borrows all of cp and tp and some of dp_shard
        check(
            d.ep % (d.cp * d.tp) == 0 and (d.dp_shard * d.cp * d.tp) % d.ep == 0,
            f"legacy EP with etp == 1 needs ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == "
            f"0; got ep={d.ep}, cp={d.cp}, tp={d.tp}, dp_shard={d.dp_shard}",
        )


def legacy(d: Degrees) -> tuple[dict[str, Kind], dict[str, str], Layout | None]:
    """Legacy ``ParallelDims.build_mesh``: (pp, dp_replicate, dp_shard, cp, tp), degree > 1 only.

    With ep > 1, dp_shard is split into dp_shard_mod_ep (always kept) x dp_shard_in_ep, and
    ``ep`` = flatten(dp_shard_in_ep, cp[, tp]). Example: world 8, dp_shard=4, tp=2, ep=4, etp=1
    has root (dp_shard_mod_ep, dp_shard_in_ep, tp) = (2, 2, 2) and ep groups (0, 1, 2, 3), (4, 5,
    6, 7).
    """
    validate_legacy(d)
    if d.ep > 1:
        borrowed = d.cp if d.etp == d.tp else d.cp * d.tp
        sizes = [
            ("pp", d.pp),
            ("dp_replicate", d.dp_replicate),
            ("dp_shard_mod_ep", d.dp_shard * borrowed // d.ep),
            ("dp_shard_in_ep", d.ep // borrowed),
            ("cp", d.cp),
            ("tp", d.tp),
        ]
        dims = [(n, s) for n, s in sizes if s > 1 or n == "dp_shard_mod_ep"]
        kept = {n for n, _ in dims}
        shard = [n for n in ("dp_shard_mod_ep", "dp_shard_in_ep") if n in kept]
        ep_dims = [n for n in ("dp_shard_in_ep", "cp") if n in kept]
        ep_dims += ["tp"] if d.etp == 1 and "tp" in kept else []
        extra = {"ep": ep_dims}
    else:
        sizes = [
            ("pp", d.pp),
            ("dp_replicate", d.dp_replicate),
            ("dp_shard", d.dp_shard),
            ("cp", d.cp),
            ("tp", d.tp),
        ]
        dims = [(n, s) for n, s in sizes if s > 1]
        kept = {n for n, _ in dims}
        shard = ["dp_shard"] if "dp_shard" in kept else []
        extra = {}
    replicate = ["dp_replicate"] if "dp_replicate" in kept else []
    cp = ["cp"] if "cp" in kept else []
    flattens = {"dp": replicate + shard, "dp_shard_cp": shard + cp, "dp_cp": replicate + shard + cp}
    kinds, root = root_kinds(dims, {**flattens, **extra}, LEGACY_DESCRIPTIONS)
    return kinds, pick_roles(kinds, LEGACY_ROLES), root


# -- hyper_parallel (seed: hyper_parallel_parallel_dims.py) -------------------------------------
HYPER_DESCRIPTIONS: Final[Mapping[str, str]] = {
    "dp_replicate": "DDP / HSDP replicate dim",
    "dp_shard": "FSDP shard dim",
    "ep": "expert parallel: an independent dim (not borrowed from dp_shard)",
    "cp": "context parallel (CP)",
    "tp": "tensor parallel (TP)",
    "pp": "pipeline parallel (PP; pp > 1 is rejected)",
    "fsdp": "alias of dp_shard: the axis fully_shard shards along",
    "dp": "flatten(dp_replicate, dp_shard): data parallel",
    "loss": "flatten(dp, cp): loss / token-count all-reduce",
}
HYPER_ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dp",
    "gradient_reduce": "loss",
    "loss": "loss",
    **AXIS_ROLES,
}


def validate_hyper(world_size: int, raw: Mapping[str, int], ulysses: int | None) -> Degrees:
    """The seed's ``_infer_and_validate``: ValueErrors, ep a factor of the world, no PP yet."""
    for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp"):
        check(raw[name] >= 1, f"Parallel degree {name}={raw[name]} must be >= 1", "ValueError")
    dp_replicate, cp, tp, pp, ep, etp = (
        raw[n] for n in ("dp_replicate", "cp", "tp", "pp", "ep", "etp")
    )
    dp_shard = raw["dp_shard"]
    check(
        not (dp_shard < -1 or dp_shard == 0),
        f"dp_shard={dp_shard} must be -1 (auto) or a positive int",
        "ValueError",
    )
    if dp_shard == -1:
        non_dp = dp_replicate * cp * tp * pp * ep
        check(
            world_size % non_dp == 0,
            f"Cannot auto-infer dp_shard: world_size={world_size} is not divisible by "
            f"dp_replicate*cp*tp*pp*ep={non_dp}",
            "ValueError",
        )
        dp_shard = max(world_size // non_dp, 1)
    product = math.prod((dp_replicate, dp_shard, cp, tp, pp, ep))
    check(
        product == world_size,
        f"Invalid parallel dims: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * "
        f"tp({tp}) * pp({pp}) * ep({ep}) = {product} != world_size({world_size}). Set "
        f"dp_shard=-1 to auto-infer.",
        "ValueError",
    )
    check(
        ep == 1 or etp in (tp, 1),
        f"etp={etp} must equal tp={tp} or 1 (expert tensor-parallel must align with TP or be "
        f"inactive)",
        "ValueError",
    )
    check(
        pp == 1,
        f"Pipeline parallel (pp={pp}>1) is not yet implemented for any model. Set pp=1 or add a "
        f"per-model PP path in models/<name>/parallelize.py before enabling.",
        "NotImplementedError",
    )
    if ulysses is not None and cp > 1:
        check(ulysses <= cp, f"ulysses_degree={ulysses} must be <= cp={cp}", "ValueError")
        check(
            cp % ulysses == 0,
            f"cp={cp} must be divisible by ulysses_degree={ulysses}",
            "ValueError",
        )
    return Degrees(world_size, dp_replicate, dp_shard, cp, tp, pp, ep, etp)


def hyper_parallel(d: Degrees) -> tuple[dict[str, Kind], dict[str, str], Layout | None]:
    """The seed's ``build_mesh``: dp_replicate -> dp_shard -> ep -> cp -> tp -> pp (degree > 1),
    or a 1-D ``dp_shard`` world when every degree is 1, then aliases ``fsdp``, ``dp``, ``loss``.

    Example: world 8, dp_replicate=2, dp_shard=2, tp=2 gives dp groups (0, 2, 4, 6), (1, 3, 5, 7)
    and ``loss`` == ``dp`` (no cp).
    """
    order = ("dp_replicate", "dp_shard", "ep", "cp", "tp", "pp")
    sizes = dict(zip(order, (d.dp_replicate, d.dp_shard, d.ep, d.cp, d.tp, d.pp)))
    dims = [(n, sizes[n]) for n in order if sizes[n] > 1] or [("dp_shard", d.world_size)]
    kept = {n for n, _ in dims}
    data = [n for n in ("dp_replicate", "dp_shard") if n in kept]
    flattens: dict[str, list[str]] = {
        "fsdp": ["dp_shard"] if "dp_shard" in kept else [],
        "dp": data,
    }
    if "cp" in kept:
        flattens["loss"] = [*data, "cp"]
    elif data:
        torch_release.require_flatten_of_flattened("hyper_parallel: mesh['dp']._flatten('loss')")
        flattens["loss"] = ["dp"]  # mesh["dp"].flatten("loss"): the same group under a 2nd name
    kinds, root = root_kinds(dims, flattens, HYPER_DESCRIPTIONS)
    return kinds, pick_roles(kinds, HYPER_ROLES), root
