"""DeepSpeed AutoEP + AutoTP folding builder: the engine's groups replayed with plain ``new_group``.

DeepSpeed's order, per ``DeepSpeedEngine._configure_expert_parallel`` and
``_configure_tensor_parallel_states`` (0.19.8):

* ``tp_size > 1`` (one stage: folding refuses pipelines): the folded
  ``_create_expert_and_data_parallel`` makes, per stage, the EP groups (``ep`` consecutive
  ranks) and the EDP groups (one position of every EP group); AutoTP's fallback
  ``_init_tp_groups_with_new_group`` then makes the dense data-parallel groups, one per TP
  lane (``range(lane, world, tp)``), and the TP groups (``tp`` consecutive ranks);
* ``tp_size == 1``: no TP group; the dense data-parallel group is every rank of a stage (the
  world's clone, or the pipeline grid's data group); the legacy expert path makes, per stage,
  the EDP groups (``range(start + i, end, ep)``) before the EP groups.

Refusals mirror ``build_folding_spec`` and ``validate_folding_global`` (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders._common import Entry, FrameworkRejection, collect, new_groups, require
from meshsim.checks import Observation
from meshsim.model.conventions import deepspeed_autoep

_SIZES = ("pp_size", "tp_size", "ep_size", "etp_size")


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Observe the folding groups of ``config`` on this rank.

    Example (world 8): ``{"tp_size": 2, "ep_size": 4}`` gives rank 5 tp ``(4, 5)``, dense_dp
    ``(1, 3, 5, 7)``, ep ``(4, 5, 6, 7)`` and edp ``(1, 5)``.
    """
    unknown = set(config) - {*_SIZES, "mp_mode"}
    if unknown:
        raise FrameworkRejection(f"unknown keys {sorted(unknown)}", upstream=None)
    sizes = deepspeed_autoep.engine_sizes(config)  # the engine's max(autotp_size, 1)
    pp, tp, ep, etp = (_size(sizes, key) for key in _SIZES)
    stage = _stage_size(world_size, pp, tp, ep, etp)
    _validate(pp, tp, ep, etp)
    stages = [list(range(s, s + stage)) for s in range(0, world_size, stage)]
    entries: dict[str, Entry] = {}
    if tp > 1:
        for ranks in stages:
            experts = [ranks[i : i + ep] for i in range(0, stage, ep)]
            _keep(entries, "ep", new_groups(experts))
            _keep(entries, "edp", new_groups([[g[pos] for g in experts] for pos in range(ep)]))
        entries["dense_dp"] = new_groups([range(lane, world_size, tp) for lane in range(tp)])
        entries["tp"] = new_groups([range(s, s + tp) for s in range(0, world_size, tp)])
    else:
        entries["dense_dp"] = new_groups(stages)
        entries["tp"] = None
        for ranks in stages:
            start, end = ranks[0], ranks[-1] + 1
            _keep(entries, "edp", new_groups([range(start + i, end, ep) for i in range(ep)]))
            _keep(entries, "ep", new_groups([range(s, s + ep) for s in range(start, end, ep)]))
    return collect({k: entries[k] for k in ("tp", "dense_dp", "ep", "edp")})


def _keep(entries: dict[str, Entry], kind: str, group: Entry) -> None:
    """Keep this rank's group of ``kind``: the one stage of all that holds it."""
    if group is not None:
        entries[kind] = group


def _size(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key, 1)
    # build_folding_spec's own test: bools are ints, numpy integers are not.
    require(isinstance(value, int) and value >= 1, f"{key} must be >= 1: {value!r}", "ValueError")
    return int(value)


def _stage_size(world_size: int, pp: int, tp: int, ep: int, etp: int) -> int:
    require(world_size % pp == 0, f"pp_size={pp} must divide {world_size}", "ValueError")
    stage = world_size // pp
    require(stage % tp == 0, f"tp_size={tp} must divide the stage size {stage}", "ValueError")
    require(stage % (ep * etp) == 0, f"ep*etp={ep * etp} must divide {stage}", "ValueError")
    return stage


def _validate(pp: int, tp: int, ep: int, etp: int) -> None:
    require(tp == 1 or pp == 1, "folding supports pp_size=1 only", "ValueError")
    require(etp == 1, f"expert_tensor_parallel_size={etp} is unsupported", "ValueError")
    require(tp == 1 or ep > 1, "folding needs ep_size > 1 with tp_size > 1", "ValueError")
