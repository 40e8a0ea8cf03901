"""Real DeepSpeed adapter: ``PipelineParallelGrid``, a tied-layer ``PipelineModule`` and MoE groups.

``build(world_size, config)`` makes DeepSpeed's own topology from meshsim's config
(``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``, ``PipeDataParallelTopology`` without
``num_mp``, ``ProcessTopology(axes, dims)``, or none: the grid's prime-factor default), builds a
``PipelineParallelGrid(topology=...)`` on the harness's process group and observes, under the
kind names of ``meshsim.model.conventions.deepspeed``:

* ``pipe`` / ``data`` / ``model``: the grid's pipe, data-parallel and slice (tensor) groups,
  ``model_parallel``: its DeepSpeed model-parallel group; axes of a raw topology other than
  those become groups of ``get_axis_comm_lists(axis)``;
* ``embedding`` (pipe > 1): the tied-module group of a ``PipelineModule`` whose first and last
  layers are one ``TiedLayerSpec`` (a GPT's embedding and LM head), one layer per stage. When
  the topology has an axis of size > 1 besides pipe/data/model (``["pipe", "data", "seq"]``)
  the module is not built and ``embedding`` is recorded absent, as the reference has it
  unavailable: ``PipelineModule._index_tied_modules`` loops over the data and model coordinates
  only, so ranks of different ``seq`` coordinates ask ``new_group`` for different rank lists and
  deadlock (seen on gloo with deepspeed 0.19.8);
* ``expert`` / ``expert_data`` (config ``ep``): the groups of a ``deepspeed.moe.layer.MoE``
  (``enable_expert_tensor_parallelism`` from the config) after ``set_deepspeed_parallelism``,
  with ``groups.mpu`` the grid as the engine sets it (None when the topology is no grid):
  DeepSpeed itself picks ``_create_expert_and_data_parallel`` or, with the flag and an mpu,
  ``_create_expert_data_and_model_parallel``.

* with ``mp_size``: ``groups._create_expert_and_data_parallel(ep, mp_size=..., mp_mode=...)``
  called directly, as the engine's AutoEP path does, with the grid as ``groups.mpu``;
* ``groups.get_tensor_model_parallel_group`` / ``get_model_parallel_group`` /
  ``get_data_parallel_group`` (config ``autotp_size``): after AutoTP's ``_init_tp_mesh_device``;
* ``_create_model_parallel.data`` / ``.model`` (config ``model_parallel_size``): the two groups
  ``groups._create_model_parallel`` returns.

``grid=True`` builds the grid whatever the axes (so a topology without ``pipe`` / ``data`` fails
as in DeepSpeed, ``AttributeError``); ``grid=False`` builds none and observes the bare topology's
``get_axis_comm_lists`` groups.

* ``p2p``: the pair of ``grid.p2p_groups`` (``[rank, next stage]`` lists, not process groups)
  this rank leads, the reference's ``keyed_by_first`` kind: a reversed pipeline neighbour shows
  as a wrong pair. Every rank also sits second in its previous stage's pair, so the pairs are
  not compared between ranks; :func:`p2p_groups` returns the whole list.

``deepspeed.comm`` is set up on the existing process group without ``init_distributed`` (see
:func:`meshsim.builders.real._shims.deepspeed_comm`). Tested with deepspeed 0.19.8
(``DS_BUILD_OPS=0 pip install --no-build-isolation 'meshsim[deepspeed]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation

#: Axes ``PipelineModule._index_tied_modules`` loops over (pipe stages, data, model coordinates).
_TIED_AXES = frozenset({"pipe", "data", "model"})
_MODULES = (
    "deepspeed.runtime.pipe.topology",
    "deepspeed.runtime.pipe.module",
    "deepspeed.utils.groups",
    "deepspeed.moe.layer",
    "deepspeed.comm.comm",
    "deepspeed.comm.torch",
)


def topology(world_size: int, config: Mapping[str, Any]) -> Any:
    """DeepSpeed's topology object for a meshsim config; None means the grid's default."""
    (topo,) = _shims.load("deepspeed.runtime.pipe.topology")
    if config.get("axes") is not None or config.get("dims") is not None:
        return topo.ProcessTopology(axes=list(config.get("axes") or ()), dims=config.get("dims"))
    if all(config.get(key) is None for key in ("num_pp", "num_mp", "num_dp")):
        return None
    num_pp = config.get("num_pp") or 1
    num_mp = config.get("num_mp")
    num_dp = config.get("num_dp") or max(world_size // (num_pp * (num_mp or 1)), 1)
    if num_mp is None:
        return topo.PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
    return topo.PipeModelDataParallelTopology(num_pp=num_pp, num_mp=num_mp, num_dp=num_dp)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Build DeepSpeed's grid (and tied / MoE groups) for ``config``; observe them by kind.

    Example (world 8): ``{"num_pp": 2, "num_mp": 2, "num_dp": 2}`` gives on rank 0 ``pipe``
    (0, 4), ``data`` (0, 2), ``model`` (0, 1), ``model_parallel`` (0, 1, 4, 5) and
    ``embedding`` (0, 4).
    """
    check_keys("deepspeed", config)
    topo_module, pipe_module, _, moe_layer, _, _ = _shims.load(*_MODULES)
    with framework_refusals():
        topo = topology(world_size, config)
    axes = ["pipe", "data"] if topo is None else list(topo.get_axis_names())
    with (
        _shims.unchanged_environ(),
        _shims.deepspeed_comm() as ds_comm,
        _shims.deepspeed_clean_moe_state() as groups,
    ):
        entries: dict[str, Entry] = {}
        grid = None
        flag = config.get("grid")
        if ({"pipe", "data"} <= set(axes)) if flag is None else bool(flag):
            with framework_refusals():
                grid = topo_module.PipelineParallelGrid(topology=topo)
            topo = grid.topology()
            entries.update(_grid_entries(grid, ds_comm, topo))
            others = [
                a for a in topo.get_axis_names() if a not in _TIED_AXES and topo.get_dim(a) > 1
            ]
            if grid.pipe_parallel_size > 1 and others:
                entries["embedding"] = RuntimeError(f"tied groups would deadlock: axes {others}")
            elif grid.pipe_parallel_size > 1:
                entries["embedding"] = _tied_group(pipe_module, topo)
        else:
            for axis in axes:
                entries[axis] = _comm_list_group(ds_comm, topo.get_axis_comm_lists(axis))
        if config.get("ep") is not None:
            entries.update(_expert_entries(groups, moe_layer, grid, config))
        entries.update(_helper_entries(groups, config))
        return collect(entries)


def _helper_entries(groups: Any, config: Mapping[str, Any]) -> dict[str, Entry]:
    """AutoTP's and ``_create_model_parallel`` 's groups, when the config asks for them."""
    entries: dict[str, Entry] = {}
    with framework_refusals():
        if config.get("autotp_size") is not None:
            groups._init_tp_mesh_device(tensor_model_parallel_size=config["autotp_size"])
            entries["groups.get_tensor_model_parallel_group"] = (
                groups.get_tensor_model_parallel_group()
            )
            entries["groups.get_model_parallel_group"] = groups.get_model_parallel_group()
            entries["groups.get_data_parallel_group"] = groups.get_data_parallel_group()
        if config.get("model_parallel_size") is not None:
            data, model = groups._create_model_parallel(config["model_parallel_size"])
            entries["_create_model_parallel.data"] = data
            entries["_create_model_parallel.model"] = model
    return entries


def p2p_groups(world_size: int, config: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The grid's ``p2p_groups``: ``[rank, next stage]`` for every rank (run on every rank)."""
    (topo_module,) = _shims.load("deepspeed.runtime.pipe.topology")
    with framework_refusals():
        topo = topology(world_size, config)
    with _shims.unchanged_environ(), _shims.deepspeed_comm():
        with framework_refusals():
            grid = topo_module.PipelineParallelGrid(topology=topo)
        return [tuple(int(r) for r in pair) for pair in grid.p2p_groups]


def _comm_list_group(ds_comm: Any, comm_lists: list[list[int]]) -> Any:
    """``new_group`` of every list on every rank (collective); this rank's group."""
    me = ds_comm.get_rank()
    mine = None
    for ranks in comm_lists:
        group = ds_comm.new_group(ranks=ranks)
        if me in ranks:
            mine = group
    return mine


def _grid_entries(grid: Any, ds_comm: Any, topo: Any) -> dict[str, Entry]:
    """The grid's groups; axes beyond pipe/data/model get their comm lists as groups."""
    entries: dict[str, Entry] = {}
    for axis in topo.get_axis_names():
        if axis == "pipe":
            entries[axis] = grid.get_pipe_parallel_group()
        elif axis == "data":
            entries[axis] = grid.get_data_parallel_group()
        elif axis != "model":
            entries[axis] = _comm_list_group(ds_comm, topo.get_axis_comm_lists(axis))
    entries["model"] = grid.get_slice_parallel_group()
    entries["model_parallel"] = grid.get_model_parallel_group()
    me = ds_comm.get_rank()
    led = [tuple(int(r) for r in pair) for pair in grid.p2p_groups if int(pair[0]) == me]
    entries["p2p"] = led[0] if led else None
    return entries


def _tied_group(pipe_module: Any, topo: Any) -> Any:
    """The tied-module group of a ``PipelineModule`` tying its first and last layer.

    One layer per stage (``partition_method="uniform"``): stage 0 and the last stage own the
    tied layer, as a GPT's embedding and LM head. The layers are 1×1 ``Linear`` s on CPU.
    """
    import torch

    stages = topo.get_dim("pipe")
    tied = pipe_module.TiedLayerSpec("embedding", torch.nn.Linear, 1, 1)
    middle = [pipe_module.LayerSpec(torch.nn.Linear, 1, 1) for _ in range(stages - 2)]
    with framework_refusals():
        module = pipe_module.PipelineModule(
            layers=[tied, *middle, tied], topology=topo, partition_method="uniform"
        )
    comms = module.tied_comms.get("embedding")
    return None if comms is None else comms["group"]


def _expert_entries(
    groups: Any, moe_layer: Any, grid: Any, config: Mapping[str, Any]
) -> dict[str, Entry]:
    """The expert / expert-data groups DeepSpeed's own ``MoE`` layer creates for ``config``.

    ``groups.mpu`` is the grid (the engine sets it so before calling
    ``set_deepspeed_parallelism``), or None without one; ``MoE._create_process_groups`` then
    picks the path from ``enable_expert_tensor_parallelism``. The experts are 1x1 ``Linear`` s on
    CPU, one per expert-parallel rank.
    """
    import torch

    ep = config["ep"]
    before = bool(config.get("use_data_before_expert_parallel_", False))
    name = f"ep_size_{ep}"
    with framework_refusals():
        groups.mpu = grid
        if config.get("mp_size") is not None:
            groups._create_expert_and_data_parallel(
                ep,
                mp_size=config["mp_size"],
                mp_mode=config.get("mp_mode") or "tp",
                use_data_before_expert_parallel_=before,
            )
            return {
                "expert": groups._get_expert_parallel_group(name),
                "expert_data": groups._get_expert_data_parallel_group(name),
            }
        layer = moe_layer.MoE(
            hidden_size=1,
            expert=torch.nn.Linear(1, 1),
            num_experts=ep,
            ep_size=ep,
            enable_expert_tensor_parallelism=bool(
                config.get("enable_expert_tensor_parallelism", False)
            ),
        )
        layer.set_deepspeed_parallelism(use_data_before_expert_parallel_=before)
        return {
            "expert": groups._get_expert_parallel_group(name),
            "expert_data": groups._get_expert_data_parallel_group(name),
        }
