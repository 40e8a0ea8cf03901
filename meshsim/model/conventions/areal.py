"""AReaL (realhf): ``ParallelGrid`` over a ``PipeDataTensorParallelTopology`` or a
``DataPipeTensorParallelTopology``, placed on the world by ``rank_mapping``.

Modelled on ``realhf/base/topology.py`` (``new_or_get_group``, ``ProcessTopology``,
``ParallelGrid.__init__``, ``_build_p2p_groups``). Unlike DeepSpeed's grid it builds a model's
groups over the world ranks ``rank_mapping`` gives its grid ranks (an RL job's actor, critic
and reference each sit on their own ranks; every rank builds every model's grid), every group
through ``new_or_get_group`` (members sorted, one object per member set and backend, shared
across models), a gloo twin of the ds-model, data, pipe and slice groups, embedding and
position-embedding groups whatever the tensor-parallel size, and a ``tp_dp`` group per stage.

Kinds are the grid's attributes, in the order the grid creates them: ``ds_model_proc_group``
(every pipe × tensor rank of one data index), ``dp_proc_group``, ``p2p_groups`` (rank lists
``[rank, next stage]``, keyed by first member), ``pp_proc_group``, ``embedding_proc_group``
(first and last stage), ``position_embedding_proc_group`` (first stage), ``slice_proc_group``
(tensor), ``tp_dp_proc_group`` (every data × tensor rank of one stage), and ``*_gloo`` twins.
Ranks outside the grid hold none. A process finds its coordinate from its rank in the model's
process group (its index among the model's world ranks, ascending), so under a ``rank_mapping``
that breaks rank order a process is handed the group of another coordinate, and holds it only
when that group happens to hold it too: :func:`order_breaks` lists who loses which group.
This is a legacy line: realhf was removed from AReaL's main branch in January 2026 (AReaL PR
806); ``areal-fsdp`` and ``areal-archon`` model the current one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from meshsim.model.conventions import reject_unknown, validate_world_size
from meshsim.model.conventions._areal_configs import configs, refused_configs
from meshsim.model.conventions._areal_grid import TOPOLOGIES, Grid, Rows, parse
from meshsim.model.conventions._areal_held import HeldGroups
from meshsim.model.expected import Expected, Kind
from meshsim.model.groups import Group, Groups, rank_group

__all__ = [
    "KINDS",
    "PARAMETERS",
    "OrderBreak",
    "SharedGroup",
    "configs",
    "expect",
    "expect_models",
    "grid",
    "order_breaks",
    "refused_configs",
    "shared_groups",
]

PARAMETERS: Final[Mapping[str, str]] = {
    "num_pp": "pipeline stages (default 1)",
    "num_dp": "data-parallel degree (default: the ranks rank_mapping covers, else the world, "
    "/ (num_pp × num_tp))",
    "num_tp": "tensor-parallel degree (default 1)",
    "topology": "'pipe_data_tensor' (PipeDataTensorParallelTopology, default) or "
    "'data_pipe_tensor' (DataPipeTensorParallelTopology, for inference); other axis orders "
    "raise KeyError",
    "rank_mapping": "grid rank -> world rank (dict, or list indexed by grid rank); the grid may "
    "cover part of the world (default: identity over the first num_pp × num_dp × num_tp ranks)",
}

#: Roles: the data-parallel group feeds batches and reduces gradients.
_ROLE_KINDS: Final[Mapping[str, str]] = {
    "data_parallel": "dp_proc_group",
    "gradient_reduce": "dp_proc_group",
    "tensor": "slice_proc_group",
    "pipeline": "pp_proc_group",
    "embedding": "embedding_proc_group",
}


@dataclass(frozen=True)
class _Spec:
    """One group attribute: how its grid-rank rows are made, its twin and getter."""

    rows: Callable[[Grid], Rows]
    description: str
    twin: bool = False
    #: Whether the rows can cover every grid rank once (embedding rows do only with one stage).
    covering: Callable[[Grid], bool] = lambda g: True


_SPECS: Final[Mapping[str, _Spec]] = {
    "ds_model_proc_group": _Spec(
        lambda g: g.fixed("data"),
        "get_model_parallel_group(): every pipe × tensor rank of one data-parallel index",
        twin=True,
    ),
    "dp_proc_group": _Spec(
        lambda g: g.comm_lists("data"),
        "get_data_parallel_group(): get_axis_comm_lists('data')",
        twin=True,
    ),
    "pp_proc_group": _Spec(
        lambda g: g.comm_lists("pipe"),
        "get_pipe_parallel_group(): get_axis_comm_lists('pipe')",
        twin=True,
    ),
    "embedding_proc_group": _Spec(
        Grid.embedding,
        "tied embedding / LM head: first and last stage of each pipe group (the one stage "
        "when num_pp is 1), whatever num_tp",
        covering=lambda g: g.dim("pipe") == 1,
    ),
    "position_embedding_proc_group": _Spec(
        Grid.position_embedding,
        "position embedding: the first stage of each pipe group",
        covering=lambda g: g.dim("pipe") == 1,
    ),
    "slice_proc_group": _Spec(
        lambda g: g.comm_lists("tensor"),
        "get_tensor_model_parallel_group(): get_axis_comm_lists('tensor')",
        twin=True,
    ),
    "tp_dp_proc_group": _Spec(
        lambda g: g.fixed("pipe"),
        "Megatron's tp+dp group: every data × tensor rank of one pipeline stage",
    ),
}
_TWIN_GETTERS: Final[Mapping[str, str]] = {
    "ds_model_proc_group": "no getter; the gloo twin of ds_model_proc_group",
    "dp_proc_group": "get_data_parallel_group_gloo()",
    "pp_proc_group": "no getter; the gloo twin of pp_proc_group (for vLLM's CPU broadcasts)",
    "slice_proc_group": "get_tensor_model_parallel_cpu_group()",
}
_P2P: Final = "p2p_groups"

#: Every kind, in the order ``ParallelGrid.__init__`` creates them.
KINDS: Final[tuple[str, ...]] = (
    "ds_model_proc_group",
    "ds_model_proc_group_gloo",
    "dp_proc_group",
    "dp_proc_group_gloo",
    _P2P,
    "pp_proc_group",
    "pp_proc_group_gloo",
    "embedding_proc_group",
    "position_embedding_proc_group",
    "slice_proc_group",
    "slice_proc_group_gloo",
    "tp_dp_proc_group",
)


def grid(world_size: int, **config: Any) -> Grid:
    """The :class:`Grid` a config places on the world (refused as AReaL refuses it)."""
    reject_unknown("areal", config, PARAMETERS)
    validate_world_size(world_size)
    return parse(world_size, config)


def expect(world_size: int, **config: Any) -> Expected:
    """Every group one model's ``ParallelGrid`` builds.

    Example: ``expect(8, num_pp=2, num_dp=2, num_tp=2)`` has ``pp_proc_group`` s ``(0, 4)``,
    ``(1, 5)``, ``(2, 6)``, ``(3, 7)``, ``dp_proc_group`` s ``(0, 2)``, ``(1, 3)``, ... and
    ``ds_model_proc_group`` s ``(0, 1, 4, 5)``, ``(2, 3, 6, 7)``; with
    ``rank_mapping=[8, 9, ..., 15]`` on a world of 16 the same groups shifted by 8, ranks 0-7
    holding none.
    """
    g = grid(world_size, **config)
    kinds = [_kind(g, name, world_size) for name in KINDS]
    name = _topology_name(g)
    normal = {
        "num_pp": g.dim("pipe"),
        "num_dp": g.dim("data"),
        "num_tp": g.dim("tensor"),
        "topology": name,
        "rank_mapping": tuple(g.mapping.tolist()),
    }
    return Expected("areal", world_size, normal, kinds, dict(_ROLE_KINDS), layout=g.placed)


def _topology_name(g: Grid) -> str:
    return next(n for n, axes in TOPOLOGIES.items() if axes == g.axes)


def _kind(g: Grid, name: str, world_size: int) -> Kind:
    if name == _P2P:
        return Kind(
            _P2P,
            "grid.p2p_groups: [rank, its next stage] for every grid rank (rank lists, no group)",
            lambda: Groups(g.p2p()),
            partition=False,
            keyed_by_first=True,
        )
    base = name.removesuffix("_gloo")
    spec = _SPECS[base]
    gloo = name != base
    complete = g.size == world_size and spec.covering(g)
    if complete and not g.keeps_order:
        complete = bool((g.holders(spec.rows(g), world_size) >= 0).all())
    description = f"{_TWIN_GETTERS[base]} (gloo)" if gloo else spec.description

    def source() -> Groups:  # computed when first asked: a million-rank world pays per kind
        rows = spec.rows(g)
        if g.keeps_order:
            return Groups(g.world_rows(rows))
        return HeldGroups(g.world_rows(rows), g.holders(rows, world_size))

    return Kind(
        name,
        description,
        source,
        partition=complete,
        backends=("gloo",) if gloo else (),
    )


def expect_models(world_size: int, configs: Iterable[Mapping[str, Any]]) -> tuple[Expected, ...]:
    """One :class:`Expected` per model of one job, in the order the job builds their grids.

    Each model keeps its own kinds (every model has a ``dp_proc_group``; a combined view would
    have to rename them), so each is checked on its own; what models share is
    :func:`shared_groups`. Example: actor on ranks 0-3 (``num_dp=4``) and critic on 4-7
    (``num_dp=4, rank_mapping=[4, 5, 6, 7]``) give ``dp_proc_group`` s ``(0, 1, 2, 3)`` and
    ``(4, 5, 6, 7)``.
    """
    return tuple(expect(world_size, **dict(config)) for config in configs)


@dataclass(frozen=True)
class SharedGroup:
    """One ``new_or_get_group`` object handed out under several names.

    ``users`` are (model index, kind) pairs, ``process_group`` standing for the model's own
    process group (``ParallelGrid``'s argument, which AReaL's callers make with
    ``new_or_get_group`` over the model's ranks).
    """

    ranks: Group
    backend: str
    users: tuple[tuple[int, str], ...]

    @property
    def models(self) -> tuple[int, ...]:
        return tuple(sorted({m for m, _ in self.users}))


def shared_groups(
    world_size: int, configs: Iterable[Mapping[str, Any]], backend: str = "nccl"
) -> list[SharedGroup]:
    """Every group object more than one (model, kind) pair holds, model by model.

    ``new_or_get_group`` keys its cache by (sorted ranks, backend): two models' groups over the
    same ranks are one object, and on a ``backend="gloo"`` world a group is its own gloo twin.
    Example: two models with ``num_dp=4`` on world 4 share every group (``models == (0, 1)``).
    """
    grids = [grid(world_size, **dict(c)) for c in configs]
    found: dict[tuple[Group, str], list[tuple[int, str]]] = {}
    for model, g in enumerate(grids):
        found.setdefault((rank_group(np.sort(g.mapping).tolist()), backend), []).append(
            (model, "process_group")
        )
        for name in KINDS:
            if name == _P2P:
                continue
            base = name.removesuffix("_gloo")
            key_backend = "gloo" if name != base else backend
            for row in g.world_rows(_SPECS[base].rows(g)).tolist():
                found.setdefault((rank_group(row), key_backend), []).append((model, name))
    return [
        SharedGroup(ranks, key_backend, tuple(dict.fromkeys(users)))
        for (ranks, key_backend), users in found.items()
        if len(dict.fromkeys(users)) > 1
    ]


@dataclass(frozen=True)
class OrderBreak:
    """A process handed another coordinate's group of ``kind``: it holds none."""

    world_rank: int
    kind: str
    believed: int
    grid_rank: int


def order_breaks(world_size: int, **config: Any) -> list[OrderBreak]:
    """Every (rank, kind) a ``rank_mapping`` that breaks rank order leaves without its group.

    Example: ``order_breaks(4, num_dp=2, num_tp=2, rank_mapping=[0, 2, 1, 3])``: world rank 1
    (grid rank 2) takes itself for grid rank 1, so it holds none of the groups its believed
    coordinate does not place it in: ``dp_proc_group``, ``slice_proc_group``,
    ``ds_model_proc_group``, ``pp_proc_group``, the embedding and position-embedding groups
    (and the gloo twins); world rank 2 likewise.
    """
    g = grid(world_size, **config)
    if g.keeps_order:
        return []
    out: list[OrderBreak] = []
    for name in KINDS:
        if name == _P2P:
            continue
        rows = _SPECS[name.removesuffix("_gloo")].rows(g)
        owner = g.holders(rows, world_size)
        member = np.zeros(world_size, dtype=bool)
        member[g.mapping[rows.ravel()]] = True
        for t in np.flatnonzero(member[g.mapping] & (owner[g.mapping] < 0)).tolist():
            out.append(OrderBreak(int(g.mapping[t]), name, int(g.believed[t]), int(t)))
    return sorted(out, key=lambda b: (b.world_rank, KINDS.index(b.kind)))
