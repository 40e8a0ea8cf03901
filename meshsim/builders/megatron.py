"""Megatron-LM builder: ``initialize_model_parallel``'s groups, derived with torch's layout algebra.

Megatron enumerates groups with ``RankGenerator`` arithmetic. Here nothing is enumerated by
hand: each generator becomes a DeviceMesh laid out from the order string (order ``a-b-c`` is
``init_device_mesh((c, b, a))``, the equivalence under test), each token group is the slice of
its axes ``_flatten``-ed by torch, the partial-optimizer / hierarchical-CP / hybrid groups are
``_unflatten`` s of live groups, and embedding groups are ``new_group`` s over the first/last
stage of the pipeline groups torch's decoder mesh holds. The expert groups come from a second
DeviceMesh built for the expert generator. The gloo twins and the all-gather dp-cp group are
``new_group`` s (backend gloo) over the families torch's meshes list; a ``HyperCommGrid`` is a
DeviceMesh over its own ranks (reversed dims) whose ``create_pg`` groups are ``_flatten`` s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import (
    Entry,
    FrameworkRejection,
    all_groups,
    collect,
    flatten,
    mesh,
    new_groups,
    reference_rules,
    require,
)
from meshsim.checks import Observation
from meshsim.model.conventions import _megatron_config

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_TOKENS = ("tp", "pp", "dp", "ep", "cp")
_DENSE = ("dp-cp", "dp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp")
_EXPERT = ("ep", "tp", "tp-ep", "tp-ep-pp", "dp")


def generator_mesh(order: str, sizes: Mapping[str, int], prefix: str = "") -> DeviceMesh:
    """A RankGenerator as a DeviceMesh: the order string reversed (slowest first) is the shape.

    Axes missing from the order are appended as slowest when of size 1, and rejected otherwise,
    as Megatron does. Dim names take ``prefix`` so two generators never share a name.
    """
    tokens = order.lower().split("-")
    for token in tokens:
        if token not in sizes:
            raise FrameworkRejection(
                f"unknown token {token!r} in order {order!r}", upstream="KeyError"
            )
    for name in _TOKENS:
        if name not in tokens:
            require(
                sizes[name] == 1,
                f"The size of ({name}) is ({sizes[name]}), but you haven't specified the order "
                f"({order}).",
                "RuntimeError",
            )
            tokens.append(name)
    slowest_first = tokens[::-1]
    return mesh([sizes[t] for t in slowest_first], [prefix + t for t in slowest_first])


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Every group ``initialize_model_parallel(**config)`` makes, in Megatron's creation order."""
    (dp, cp, edp, instances), decoder, expert = _validate(world_size, config)
    hcp = tuple(config.get("hierarchical_context_parallel_sizes") or ())
    entries: dict[str, Entry] = {}
    groups = {token: _token_mesh(decoder, token) for token in _DENSE}
    entries["dp-cp"] = groups["dp-cp"]
    # megatron 0.16.1 sets it with one instance too (the whole dp-cp group)
    entries["intra_dp_cp"] = _chunks(groups["dp-cp"], dp * cp // instances, "intra_dp_cp")
    if config.get("hybrid_context_parallel"):
        width = dp * cp
        for size in (2**i for i in range(1, int(math.log2(width)))):
            if width % size == 0:
                entries[f"hybrid_dp_cp:{size}"] = _chunks(groups["dp-cp"], size, f"hybrid{size}")
    entries["dp"], entries["cp"] = groups["dp"], groups["cp"]
    if hcp:
        levels = [f"hcp{i}" for i in range(len(hcp))]
        split = torch_private.unflatten(groups["cp"], 0, hcp[::-1], levels[::-1], emulate=True)
        for i, name in enumerate(levels):
            entries[f"hierarchical_cp:{i}"] = split[name]
    for token in ("tp-pp", "tp", "pp"):
        entries[token] = groups[token]
    entries.update(_embedding_groups(decoder, groups["pp"], config))
    for token in ("tp-dp-cp", "tp-dp", "tp-cp"):
        entries[token] = groups[token]
    for token in _EXPERT:
        entries[f"expert:{token}"] = _token_mesh(expert, token, "expert:")
    entries.update(_partial_expert_groups(expert, edp, instances))
    entries = _with_twins(entries, config, decoder, expert, instances)
    if config.get("hyper_comm_grid"):
        entries.update(_grid_groups(world_size, config["hyper_comm_grid"]))
    return collect(entries)


def _with_twins(
    entries: dict[str, Entry],
    config: Mapping[str, Any],
    decoder: DeviceMesh,
    expert: DeviceMesh,
    instances: int,
) -> dict[str, Entry]:
    """Each entry followed by the groups made over the same ranks: ``dp-cp:ag`` (a second
    default-backend group) and the gloo twins; ones not made are the getter's AssertionError.
    The intra groups split each dp-cp / expert dp group into ``instances`` parts."""
    dp_cp = all_groups(decoder, ["dp", "cp"])
    expert_dp = all_groups(expert, ["expert:dp"])
    split_intra = torch.tensor(expert_dp).reshape(-1, len(expert_dp[0]) // instances)
    families: dict[str, list[list[int]]] = {
        "dp-cp": dp_cp,
        "intra_dp_cp": torch.tensor(dp_cp).reshape(-1, len(dp_cp[0]) // instances).tolist(),
        "dp": all_groups(decoder, ["dp"]),
        "expert:dp": expert_dp,
        "expert:intra_dp": split_intra.tolist(),
    }
    gloo = config.get("create_gloo_process_groups", True)
    out: dict[str, Entry] = {}
    for name, entry in entries.items():
        out[name] = entry
        if name == "dp-cp":
            made = bool(config.get("create_all_gather_group"))
            out["dp-cp:ag"] = new_groups(dp_cp) if made else AssertionError("no AG group")
        if name in families:
            out[f"{name}:gloo"] = (
                new_groups(families[name], gloo=True) if gloo else AssertionError(name)
            )
    return out


def _grid_groups(world_size: int, spec: Mapping[str, Any]) -> dict[str, Entry]:
    """A HyperCommGrid: its dims reversed lay out a DeviceMesh over its ranks, and each
    ``create_pg`` is a ``new_group`` per group spanning the dims, read off that mesh. (Not
    slices: torch slices a mesh only on its member ranks, and the grid may leave ranks out.)"""
    shape = [int(s) for s in spec["shape"]]
    names = [str(n) for n in spec["dim_names"]]
    offset = int(spec.get("rank_offset", 0))
    require(len(shape) == len(names), "len(shape) != len(dim_names)", "ValueError")
    require(offset >= 0, f"rank_offset must be non-negative, got {offset}", "ValueError")
    size = math.prod(shape)
    require(size <= world_size - offset, f"grid shape {shape} is over sized", "RuntimeError")
    root: DeviceMesh | None = None
    entries: dict[str, Entry] = {}
    for dims in spec.get("pgs", ()):
        ordered = _grid_dims(names, dims)
        key = "-".join(ordered)
        require(f"hyper_comm_grid[{key}]" not in entries, f"{key} already created", "KeyError")
        usable = all(n.isidentifier() and n[0] != "_" and n[-1] != "_" for n in names)
        unique = len(set(names)) == len(names) and len(set(ordered)) == len(ordered)
        require(usable and unique and set(ordered) <= set(names), f"einops: {dims}", "EinopsError")
        if root is None:
            ranks = torch.arange(offset, offset + size).reshape(shape[::-1])
            root = DeviceMesh(
                _device_type(), ranks, mesh_dim_names=tuple(names[::-1]), _init_backend=False
            )
        entries[f"hyper_comm_grid[{key}]"] = new_groups(all_groups(root, ordered))
    return entries


def _grid_dims(names: list[str], dims: Any) -> list[str]:
    """``create_pg``'s reading of ``dims``: a string as given, a list slowest dim first."""
    if isinstance(dims, str):
        return [dims]
    slowest_first = names[::-1]
    require(all(d in slowest_first for d in dims), f"unknown dims in {dims}", "ValueError")
    require(len(dims) > 0, "create_pg([]) spans no dim", "TypeError")
    return [slowest_first[i] for i in sorted(slowest_first.index(d) for d in dims)]


def _device_type() -> str:
    return "cuda" if str(dist.get_backend()) == "nccl" else "cpu"


def _validate(
    world_size: int, config: Mapping[str, Any]
) -> tuple[tuple[int, int, int, int], DeviceMesh, DeviceMesh]:
    """Megatron's checks in its order (the convention's statement of them); (dp, cp, edp,
    instances) and the two generator meshes, built live from the sizes."""
    order = config.get("order") or DEFAULT_ORDER
    with reference_rules():
        sizes, _, _ = _megatron_config.validate(world_size, config, order)
    tp, pp, cp, ep, etp = sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp
    decoder = generator_mesh(order, {"tp": tp, "pp": pp, "dp": sizes.dp, "ep": 1, "cp": cp})
    expert = generator_mesh(
        order, {"tp": etp, "pp": pp, "dp": sizes.edp, "ep": ep, "cp": 1}, "expert:"
    )
    return (sizes.dp, cp, sizes.edp, sizes.instances), decoder, expert


def _token_mesh(root: DeviceMesh, token: str, prefix: str = "") -> DeviceMesh:
    """The group spanning the token's axes: the axes' slice of ``root``, flattened by torch."""
    return flatten(root, [prefix + t for t in token.split("-")], prefix + token)


def _chunks(group: DeviceMesh, size: int, name: str) -> DeviceMesh:
    """Consecutive chunks of ``size`` members of a live 1-D group (``_unflatten``, inner dim)."""
    outer = (group.size() // size, size), (f"{name}_outer", name)
    return torch_private.unflatten(group, 0, *outer, emulate=True)[name]


def _embedding_groups(
    decoder: DeviceMesh, pp_mesh: DeviceMesh, config: Mapping[str, Any]
) -> dict[str, Entry]:
    """Embedding and position-embedding groups, one per pipeline, via ``new_group``."""
    pipelines = all_groups(decoder, ["pp"])
    mine = [int(r) for r in dist.get_process_group_ranks(pp_mesh.get_group())]
    if mine not in pipelines:
        raise RuntimeError(f"live pp group {mine} is not among the mesh's pp groups")

    def default_embedding(ranks: list[int]) -> list[int]:
        return [ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]]

    embedding = config.get("get_embedding_ranks") or default_embedding
    position = config.get("get_position_embedding_ranks") or (lambda ranks: [ranks[0]])
    return {
        "embedding": new_groups([list(embedding(list(p))) for p in pipelines]),
        "position_embedding": new_groups([list(position(list(p))) for p in pipelines]),
    }


def _partial_expert_groups(expert: DeviceMesh, edp: int, instances: int) -> dict[str, Entry]:
    """Expert DP split hierarchically as [edp / k, k], and one optimizer instance's ranks."""
    sizes = (instances, edp // instances)
    split = torch_private.unflatten(expert, "expert:dp", sizes, ("inter", "intra"), emulate=True)
    names = tuple(split.mesh_dim_names or ())
    shape = dict(zip(names, split.mesh.shape))
    # Size-1 dims leave the group as it is; torch 2.10-2.12 refuse some slices through them
    # (their strides are compared too), so only the dims that matter are sliced.
    rest = tuple(n for n in names if n != "inter" and shape[n] > 1) or ("intra",)
    entries = {
        "expert:intra_dp": split["intra"],
        "expert:inter_dp": split["inter"],
        "intra_dist_opt_instance": torch_private.flatten(split[rest], "intra_dist_opt_instance"),
    }
    if instances == 1:  # megatron builds no inter-instance group with one instance
        del entries["expert:inter_dp"]
    return entries
