"""Rank tables of the ``deepspeed/utils/groups.py`` helpers outside the pipeline grid, and the
``PipelineModule`` partition boundaries, vectorised where they are groups.

Written from deepspeed 0.19.8: ``_create_expert_and_data_parallel`` with ``mp_size > 1`` (the
engine's AutoEP path, ``mp_mode`` ``"tp"`` or ``"sp"``), ``_create_model_parallel`` (a helper
DeepSpeed marks unused but still ships), the AutoTP ``_init_tp_mesh_device`` /
``_init_tp_groups_with_new_group`` pair, and ``partition_uniform`` / ``partition_balanced``
behind ``PipelineModule(partition_method="uniform" | "parameters")``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.groups import Groups

__all__ = [
    "MP_MODES",
    "autotp_ranks",
    "create_model_parallel_ranks",
    "mp_expert_and_data_parallel_ranks",
    "partition_parts",
]

#: ``mp_mode`` values the engine passes (``"tp"`` when tp > 1, else ``"sp"``).
MP_MODES = ("tp", "sp")


def mp_expert_and_data_parallel_ranks(
    world_size: int,
    expert_parallel_size: int,
    mp_size: int,
    mp_mode: str = "tp",
    pipeline_parallel_size: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[Groups, Groups]:
    """``_create_expert_and_data_parallel(ep, mp_size=mp, mp_mode=...)`` with ``mp > 1`` and no
    folding spec: (expert-parallel groups, expert-data-parallel groups).

    Each pipeline stage's ranks are reordered (``"tp"``: lane-major, so rank ``s + i·mp + lane``
    moves to position ``lane·(stage/mp) + i``; ``"sp"``: kept consecutive), cut into EP chunks of
    ``ep``, and position ``j`` of every chunk forms an expert-DP group.

    Example: world 8, ep 2, mp 2, ``"tp"`` gives EP ``[0, 2]``, ``[4, 6]``, ``[1, 3]``, ``[5, 7]``
    and expert DP ``[0, 1, 4, 5]``, ``[2, 3, 6, 7]`` (members ascending; DeepSpeed lists them in
    chunk order, ``[0, 4, 1, 5]``, and ``new_group`` sorts them).
    """
    ep, mp, pp = expert_parallel_size, mp_size, pipeline_parallel_size
    if use_data_before_expert_parallel_:
        raise LayoutError(
            "_create_expert_and_data_parallel: use_data_before_expert_parallel_ is not supported "
            f"with mp_size > 1 (got mp_size {mp})",
            upstream="NotImplementedError",
        )
    if mp_mode not in MP_MODES:
        raise LayoutError(f"mp_mode must be one of {MP_MODES}, got {mp_mode!r}")
    stage = world_size // pp
    if stage % ep:
        raise LayoutError(
            f"{stage} is not divisible by {ep}: _create_expert_and_data_parallel needs the ranks "
            f"of one pipeline stage (world {world_size} / pp {pp}) to be divisible by the expert "
            "parallel size",
            upstream="AssertionError",
        )
    if mp_mode == "tp" and stage % mp:
        # DeepSpeed drops the stage's last stage % mp ranks from every group; the getters then
        # assert on those ranks ("expert parallel group is not initialized").
        raise LayoutError(
            f"mp_size {mp} does not divide the {stage} ranks of a pipeline stage: "
            "_create_expert_and_data_parallel(mp_mode='tp') leaves ranks without an expert group",
            upstream="AssertionError",
        )
    ranks = np.arange(world_size, dtype=np.int64).reshape(pp, stage)
    if mp_mode == "tp":
        ranks = ranks.reshape(pp, stage // mp, mp).swapaxes(1, 2).reshape(pp, stage)
    chunks = ranks.reshape(pp, stage // ep, ep)
    experts = np.sort(chunks.reshape(-1, ep), axis=1)
    return Groups(experts), Groups(np.sort(chunks.swapaxes(1, 2).reshape(-1, stage // ep), axis=1))


def _check_divides(world_size: int, size: int, what: str) -> None:
    if world_size % size:
        raise LayoutError(
            f"{world_size} is not divisible by {size}: {what}", upstream="AssertionError"
        )


def create_model_parallel_ranks(world_size: int, model_parallel_size: int) -> tuple[Groups, Groups]:
    """``_create_model_parallel(mp)``: (data-parallel groups, model-parallel groups).

    The size is clamped to the world (``min(mp, world)``); model groups are consecutive chunks,
    data groups stride by it. Example: world 8, mp 2 gives model ``[0, 1]``, ``[2, 3]``, ... and
    data ``[0, 2, 4, 6]``, ``[1, 3, 5, 7]``.
    """
    mp = min(model_parallel_size, world_size)
    _check_divides(world_size, mp, "_create_model_parallel needs mp to divide the world")
    table = np.arange(world_size, dtype=np.int64).reshape(world_size // mp, mp)
    return Groups(table.T), Groups(table)


def autotp_ranks(
    world_size: int, tensor_model_parallel_size: int, data_parallel_size: int | None = None
) -> tuple[Groups, Groups]:
    """AutoTP's ``_init_tp_mesh_device`` (a ``(data_parallel, tensor_parallel)`` DeviceMesh) or
    ``_init_tp_groups_with_new_group`` (the same rank lists): (data groups, tensor groups).

    ``get_model_parallel_group()`` is then the tensor group. Example: world 8, tp 4 gives tensor
    ``[0..3]``, ``[4..7]`` and data ``[0, 4]``, ``[1, 5]``, ...
    """
    tp = tensor_model_parallel_size
    if world_size % tp:
        # _init_tp_mesh_device does not check: its (world // tp, tp) mesh leaves the last ranks
        # out, which then fail while the others go on (a hang, not a clean exception).
        raise LayoutError(
            f"AutoTP tensor_model_parallel_size {tp} does not divide the world {world_size}: "
            "_init_tp_mesh_device's (world // tp, tp) mesh would leave ranks out"
        )
    dp = world_size // tp if data_parallel_size is None else data_parallel_size
    if dp * tp != world_size:
        raise LayoutError(
            f"data_parallel_size ({dp}) * tensor_model_parallel_size ({tp}) must equal "
            f"world_size ({world_size})",
            upstream="AssertionError",
        )
    table = np.arange(world_size, dtype=np.int64).reshape(dp, tp)
    return Groups(table.T), Groups(table)


def partition_parts(
    num_stages: int, weights: Sequence[float], method: str = "uniform"
) -> list[int]:
    """``PipelineModule.parts``: stage ``s`` owns layers ``parts[s]:parts[s + 1]``.

    ``"uniform"`` (``partition_uniform``): equal counts, the first ``layers % stages`` stages one
    more; with no more layers than stages, stage ``s`` starts at ``min(s, layers)``.
    ``"parameters"`` (``partition_balanced`` over each layer's trainable parameter count): the
    contiguous split minimising (heaviest − lightest stage), ties to the latest cut, as
    DeepSpeed's dynamic programme breaks them. Example: ``partition_parts(2, [1] * 5)`` is
    ``[0, 3, 5]``; ``partition_parts(2, [4, 1, 1, 1, 1], "parameters")`` is ``[0, 1, 5]``.
    """
    method = method.lower()
    n, m = len(weights), num_stages
    if m < 1:
        raise LayoutError(f"num_stages must be >= 1, got {m}")
    if method == "uniform" or (method == "parameters" and n <= m):
        if n <= m:
            return [min(p, n) for p in range(m + 1)]
        chunk, extra = divmod(n, m)
        return [p * chunk + min(p, extra) for p in range(m + 1)]
    if method != "parameters":
        raise LayoutError(
            f"Partitioning method {method} not implemented.", upstream="NotImplementedError"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # best[i][j] = (cost, heaviest, lightest, cut) for the first i layers on j stages.
    high = [[inf] * (m + 1) for _ in range(n + 1)]
    low = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    high[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                load = prefix[i] - prefix[k]
                hi, lo = max(high[k][j - 1], load), min(low[k][j - 1], load)
                if cost[i][j] >= hi - lo:
                    cost[i][j], high[i][j], low[i][j], cut[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]
