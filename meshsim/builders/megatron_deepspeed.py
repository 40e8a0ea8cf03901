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

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim import torch_private
from meshsim.builders import _common
from meshsim.builders._common import Entry, all_groups, collect, flatten, mesh, new_groups
from meshsim.checks import Observation
from meshsim.model.conventions import megatron_deepspeed


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    with _common.reference_rules():
        checked = megatron_deepspeed.validate(world_size, config)
    variant, tp, pp, sp, dp, split = dataclasses.astuple(checked)

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
    elif variant == "upstream":
        entries["amax"] = AssertionError("FP8 amax reduction group is not initialized")
    return collect(entries)


def _gloo_groups(groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """``new_group(ranks, backend="gloo")`` for every dp group; this rank's (a seam the tests
    replace)."""
    return new_groups(groups, gloo=True)


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
    return {
        "embedding": new_groups(embedding),
        "position_embedding": new_groups(position),
    }
