"""Megatron-DeepSpeed builder: legacy ``initialize_model_parallel`` (+ Ulysses SP) on torch meshes.

Megatron-DeepSpeed builds its groups with ``range`` loops. Here the world is one DeviceMesh over
the axes those loops stride by, ``(pp, dp, sp, tp)`` (tp fastest, pp slowest), every group is a
slice or ``_flatten`` of it, the FP8 amax groups are an ``_unflatten`` of a 1-D world mesh into
contiguous blocks, and the embedding groups and the gloo twins of the dp groups
(``use_distributed_optimizer``) are ``new_group`` s over families torch's mesh lists.

Both lines (``variant`` "upstream" and "habana-2024") build the same groups; they differ in the
getters. The one the builder sees: upstream's ``get_data_parallel_group_gloo()`` asserts when no
gloo twin was made, and the Habana line has no such getter at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
    require,
)
from meshsim.checks import Observation

_VARIANTS = ("upstream", "habana-2024")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    variant = config.get("variant", "upstream")
    require(variant in _VARIANTS, f"no megatron-deepspeed variant {variant!r}", None)
    tp = _integer(config, "tensor_model_parallel_size")
    pp = _integer(config, "pipeline_model_parallel_size")
    sp = _integer(config, "sequence_parallel_size")
    split = config.get("pipeline_model_parallel_split_rank")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)):
        raise FrameworkRejection(f"pipeline_model_parallel_split_rank {split!r}", upstream=None)
    vpp = config.get("virtual_pipeline_model_parallel_size")
    dp = _checked_dp(world_size, (tp, pp, sp), vpp, split)

    world = mesh((pp, dp, sp, tp), ("pp", "dp", "sp", "tp"))
    entries: dict[str, Entry] = {"dp": world["dp"]}
    if config.get("use_distributed_optimizer"):
        entries["dp:gloo"] = _gloo_groups(all_groups(world, ["dp"]))
    elif variant == "upstream":
        entries["dp:gloo"] = AssertionError("data parallel group-gloo is not initialized")
    entries.update(
        {
            "sp": world["sp"],
            "seq_dp": flatten(world, ["dp", "sp"], "seq_dp"),
            "mp": flatten(world, ["pp", "tp"], "mp"),
            "tp": world["tp"],
            "pp": world["pp"],
        }
    )
    entries.update(_embedding_groups(world, pp, split))
    if config.get("use_fp8"):
        # Contiguous blocks of tp * dp ranks, whatever the mesh: unflatten the world into them.
        line = mesh((world_size,), ("ranks",))
        sizes = (world_size // (tp * dp), tp * dp)
        blocks = torch_private.unflatten(line, 0, sizes, ("amax_outer", "amax"), emulate=True)
        entries["amax"] = blocks["amax"]
    return collect(entries)


def _integer(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FrameworkRejection(f"{key} must be an integer, got {value!r}", upstream=None)
    return value


def _checked_dp(world: int, degrees: tuple[int, int, int], vpp: Any, split: int | None) -> int:
    """Upstream's checks and arithmetic in its order; the data-parallel degree they leave.

    A negative degree passes them (Python's ``%`` and ``//`` take it) but the ``range`` loops
    over it run zero times: no dp groups, so either the model-parallel loop asks torch for
    ``new_group([])`` (when dp > 0) or a getter later finds its group missing.
    """
    tp, pp, sp = degrees
    if tp * pp == 0:
        raise FrameworkRejection("integer modulo by zero", upstream="ZeroDivisionError")
    require(
        world % (tp * pp) == 0,
        f"world_size ({world}) is not divisible by tensor_model_parallel_size ({tp}) x "
        f"pipeline_model_parallel_size ({pp})",
        "RuntimeError",
    )
    require(
        sp <= 1 or (tp == 1 and pp == 1),
        "DeepSpeed's sequence parallel does not work with tensor parallel or pipeline parallel",
    )
    require(sp <= 1 or world % sp == 0, f"world_size is not divisible by {sp}", "RuntimeError")
    if sp == 0 or world // (tp * pp * sp) == 0:
        raise FrameworkRejection("integer division by zero", upstream="ZeroDivisionError")
    dp = world // (tp * pp * sp)
    require(
        vpp is None or pp > 2,
        "pipeline-model-parallel size should be greater than 2 with interleaved schedule",
        "RuntimeError",
    )
    data_groups_built = tp > 0 and pp > 0
    require(data_groups_built or dp < 1, "new_group([]) for a model-parallel group", "TypeError")
    if split is not None and pp > 1:  # each pipeline's ranks, indexed by the split stage
        try:
            range(0, world, world // pp)[split]
        except IndexError as error:
            raise FrameworkRejection(str(error), upstream="IndexError") from error
    require(data_groups_built, "data parallel group is not initialized")
    require(sp > 0, "sequence parallel group is not initialized")
    return dp


def _gloo_groups(groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """``new_group(ranks, backend="gloo")`` for every dp group; this rank's. The fake backend
    (no gloo behind it) gets default-backend groups: its groups are metadata only anyway."""
    backend = None if str(dist.get_backend()) == "fake" else "gloo"
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks=list(ranks), backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _embedding_groups(world: DeviceMesh, pp: int, split: int | None) -> dict[str, Entry]:
    """[first, (split,) last] and [first, (split)] of every pipeline, each a ``new_group``."""
    embedding, position = [], []
    for ranks in all_groups(world, ["pp"]):
        if pp > 1:
            emb, pos = [ranks[0], ranks[-1]], [ranks[0]]
            if split is not None:
                stage = ranks[split]  # in range: checked with the config
                if stage not in emb:
                    emb = [ranks[0], stage, ranks[-1]]
                if stage not in pos:
                    pos = [ranks[0], stage]
        else:
            emb = pos = list(ranks)
        embedding.append(emb)
        position.append(pos)
    return {"embedding": new_groups(embedding), "position_embedding": new_groups(position)}
