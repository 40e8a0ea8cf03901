"""Megatron-DeepSpeed builder: legacy ``initialize_model_parallel`` (+ Ulysses SP) on torch meshes.

Megatron-DeepSpeed builds its groups with ``range`` loops. Here the world is one DeviceMesh over
the axes those loops stride by, ``(pp, dp, sp, tp)`` (tp fastest, pp slowest), every group is a
slice or ``_flatten`` of it, the FP8 amax groups are an ``_unflatten`` of a 1-D world mesh into
contiguous blocks, and the embedding groups are ``new_group`` s over the first / split / last
stage of the pipelines torch's mesh holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders._common import (
    Entry,
    FrameworkRejection,
    all_groups,
    collect,
    degree,
    flatten,
    mesh,
    new_groups,
    require,
)
from meshsim.checks import Observation


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    tp = degree(config, "tensor_model_parallel_size")
    pp = degree(config, "pipeline_model_parallel_size")
    sp = degree(config, "sequence_parallel_size")
    vpp = config.get("virtual_pipeline_model_parallel_size")
    split = config.get("pipeline_model_parallel_split_rank")
    require(
        world_size % (tp * pp) == 0,
        f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
        f"pipeline_model_parallel_size ({pp})",
        "RuntimeError",
    )
    require(
        sp == 1 or (tp == 1 and pp == 1),
        "DeepSpeed's sequence parallel does not work with tensor parallel or pipeline parallel",
    )
    require(sp == 1 or world_size % sp == 0, f"world_size is not divisible by {sp}", "RuntimeError")
    require(
        vpp is None or pp > 2,
        "pipeline-model-parallel size should be greater than 2 with interleaved schedule",
        "RuntimeError",
    )
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)):
        raise FrameworkRejection(f"pipeline_model_parallel_split_rank {split!r}", upstream=None)
    dp = world_size // (tp * pp * sp)

    world = mesh((pp, dp, sp, tp), ("pp", "dp", "sp", "tp"))
    entries: dict[str, Entry] = {
        "dp": world["dp"],
        "sp": world["sp"],
        "seq_dp": flatten(world, ["dp", "sp"], "seq_dp"),
        "mp": flatten(world, ["pp", "tp"], "mp"),
        "tp": world["tp"],
        "pp": world["pp"],
    }
    entries.update(_embedding_groups(world, pp, split))
    if config.get("use_fp8"):
        # Contiguous blocks of tp * dp ranks, whatever the mesh: unflatten the world into them.
        line = mesh((world_size,), ("ranks",))
        sizes = (world_size // (tp * dp), tp * dp)
        blocks = torch_private.unflatten(line, 0, sizes, ("amax_outer", "amax"), emulate=True)
        entries["amax"] = blocks["amax"]
    return collect(entries)


def _embedding_groups(world: DeviceMesh, pp: int, split: int | None) -> dict[str, Entry]:
    """[first, (split,) last] and [first, (split)] of every pipeline, each a ``new_group``."""
    embedding, position = [], []
    for ranks in all_groups(world, ["pp"]):
        if pp > 1:
            emb, pos = [ranks[0], ranks[-1]], [ranks[0]]
            if split is not None:
                try:
                    stage = ranks[split]
                except IndexError as error:
                    raise FrameworkRejection(str(error), upstream="IndexError") from error
                if stage not in emb:
                    emb = [ranks[0], stage, ranks[-1]]
                if stage not in pos:
                    pos = [ranks[0], stage]
        else:
            emb = pos = list(ranks)
        embedding.append(emb)
        position.append(pos)
    return {"embedding": new_groups(embedding), "position_embedding": new_groups(position)}
