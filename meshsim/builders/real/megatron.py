"""Real Megatron adapter: megatron-core's ``initialize_model_parallel`` and its group getters.

``build(world_size, config)`` passes meshsim's Megatron config (its keys are megatron-core's own
parameter names: ``tensor_model_parallel_size``, ``order``, ...) to
``megatron.core.parallel_state.initialize_model_parallel`` and observes what each getter hands
this rank, under the kind names of ``meshsim.model.conventions.megatron``: ``dp`` is
``get_data_parallel_group()``, ``dp-cp`` is ``get_data_parallel_group(with_context_parallel=True)``,
``expert:ep`` is ``get_expert_model_parallel_group()``, and so on (see :data:`GETTERS`). The
hybrid DP×CP sizes observed are the ones megatron itself created. ``parallel_state`` is reset with
``destroy_model_parallel()`` before and after. The gloo twins (``dp:gloo`` is
``get_data_parallel_group_gloo()``, ...) are made as megatron makes them by default; a getter that
asserts (a twin not made) is recorded absent. ``hyper_comm_grid`` builds megatron's own
``HyperCommGrid`` after ``initialize_model_parallel`` and calls ``create_pg`` for each entry of
``pgs``; each group is observed under the key the grid stored it under (``get_pg`` returns it).
Tested with megatron-core 0.16.1 (``pip install 'meshsim[megatron]'``; hierarchical CP and
``HyperCommGrid`` also need ``einops``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation

#: meshsim config keys passed to ``initialize_model_parallel`` unchanged (same names).
PASSED = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel",
    "expert_model_parallel_size",
    "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size",
    "order",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "create_gloo_process_groups",
    "create_all_gather_group",
)

Getter = Callable[[Any], Any]

#: kind name -> the ``parallel_state`` call that returns this rank's group of that kind, in the
#: order ``initialize_model_parallel`` creates them.
GETTERS: Mapping[str, Getter] = {
    "dp-cp": lambda ps: ps.get_data_parallel_group(with_context_parallel=True),
    "dp-cp:ag": lambda ps: ps.get_data_parallel_group(
        with_context_parallel=True, independent_all_gather=True
    ),
    "dp-cp:gloo": lambda ps: ps.get_data_parallel_group_gloo(with_context_parallel=True),
    "dp": lambda ps: ps.get_data_parallel_group(),
    "dp:gloo": lambda ps: ps.get_data_parallel_group_gloo(),
    "cp": lambda ps: ps.get_context_parallel_group(),
    "tp-pp": lambda ps: ps.get_model_parallel_group(),
    "tp": lambda ps: ps.get_tensor_model_parallel_group(),
    "pp": lambda ps: ps.get_pipeline_model_parallel_group(),
    "embedding": lambda ps: ps.get_embedding_group(check_initialized=False),
    "position_embedding": lambda ps: ps.get_position_embedding_group(check_initialized=False),
    "tp-dp-cp": lambda ps: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "tp-dp": lambda ps: ps.get_tensor_and_data_parallel_group(),
    "tp-cp": lambda ps: ps.get_tensor_and_context_parallel_group(),
    "expert:ep": lambda ps: ps.get_expert_model_parallel_group(),
    "expert:tp": lambda ps: ps.get_expert_tensor_parallel_group(),
    "expert:tp-ep": lambda ps: ps.get_expert_tensor_and_model_parallel_group(),
    "expert:tp-ep-pp": lambda ps: ps.get_expert_tensor_model_pipeline_parallel_group(),
    "expert:dp": lambda ps: ps.get_expert_data_parallel_group(),
    "expert:dp:gloo": lambda ps: ps.get_expert_data_parallel_group_gloo(),
}

#: Partial distributed optimizer; with one instance they span dp-cp / expert dp (no inter group).
PARTIAL_GETTERS: Mapping[str, Getter] = {
    "intra_dp_cp": lambda ps: ps.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=True
    ),
    "intra_dp_cp:gloo": lambda ps: ps.get_data_parallel_group_gloo(
        with_context_parallel=True, partial_data_parallel=True
    ),
    "expert:intra_dp": lambda ps: ps.get_expert_data_parallel_group(
        partial_expert_data_parallel=True
    ),
    "expert:intra_dp:gloo": lambda ps: ps.get_expert_data_parallel_group_gloo(
        partial_expert_data_parallel=True
    ),
    "expert:inter_dp": lambda ps: ps.get_inter_distributed_optimizer_instance_group(),
    "intra_dist_opt_instance": lambda ps: ps.get_intra_distributed_optimizer_instance_group(),
}


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run ``initialize_model_parallel(**config)`` on this rank and observe every getter.

    Example (world 8): ``{"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}``
    gives ``tp`` (0, 1), ``dp`` (0, 2), ``pp`` (0, 4) on rank 0, and ``embedding`` (0, 4).
    """
    check_keys("megatron", config)
    _shims.load("megatron.core.parallel_state")
    del world_size  # megatron reads it from torch.distributed
    kwargs = {key: config[key] for key in PASSED if config.get(key) is not None}
    grid = config.get("hyper_comm_grid")
    with _shims.unchanged_environ(), _shims.megatron_clean_state() as ps:
        with framework_refusals():
            ps.initialize_model_parallel(**kwargs)
        entries: dict[str, Entry] = {}
        for name, getter in GETTERS.items():
            entries[name] = _call(getter, ps)
            if name == "dp-cp":
                entries.update(_hybrid(ps, config))
            elif name == "cp":
                entries.update(_hierarchical(ps, config))
        single = (config.get("num_distributed_optimizer_instances") or 1) == 1
        for name, getter in PARTIAL_GETTERS.items():
            if not (single and name == "expert:inter_dp"):  # upstream leaves it unset
                entries[name] = _call(getter, ps)
        if grid:
            entries.update(_hyper_comm_grid(grid))
        return collect(entries)


def _call(getter: Getter, ps: Any) -> Entry:
    """The getter's group, or the AssertionError it raises for a group megatron did not make
    (a gloo twin with ``create_gloo_process_groups=False``, ``dp-cp:ag`` by default)."""
    try:
        group: Entry = getter(ps)
    except AssertionError as error:
        return error
    return group


def _hyper_comm_grid(spec: Mapping[str, Any]) -> dict[str, Entry]:
    """megatron's ``HyperCommGrid(shape, dim_names, rank_offset)`` and one ``create_pg`` per
    entry of ``pgs`` (a sequence passed as a list); each group named after the key the grid
    stored it under and read back with ``get_pg``. Ranks outside the grid get None."""
    (hyper_comm_grid,) = _shims.load("megatron.core.hyper_comm_grid")
    if not hyper_comm_grid.HAVE_EINOPS:  # megatron would raise RuntimeError: not a refusal
        raise ImportError("megatron's HyperCommGrid needs einops: pip install einops")
    entries: dict[str, Entry] = {}
    with framework_refusals():
        grid = hyper_comm_grid.HyperCommGrid(
            list(spec["shape"]), list(spec["dim_names"]), rank_offset=spec.get("rank_offset", 0)
        )
        for dims in spec.get("pgs", ()):
            call = dims if isinstance(dims, str) else list(dims)
            before = set(grid._pgs)  # the grid's store of created groups, by key
            grid.create_pg(call)
            (key,) = set(grid._pgs) - before
            entries[f"hyper_comm_grid[{key}]"] = grid.get_pg(call)
    return entries


def _hybrid(ps: Any, config: Mapping[str, Any]) -> dict[str, Entry]:
    """The hybrid DP×CP groups of every size megatron chose to make (its dict's keys)."""
    entries: dict[str, Entry] = {}
    if config.get("hybrid_context_parallel"):
        for size in sorted(ps._HYBRID_DP_CP_GROUPS):
            entries[f"hybrid_dp_cp:{size}"] = ps.get_hybrid_data_context_parallel_groups(
                group_size=size
            )
    return entries


def _hierarchical(ps: Any, config: Mapping[str, Any]) -> dict[str, Entry]:
    """One kind per hierarchical-CP level, innermost first, as megatron lists them."""
    if not config.get("hierarchical_context_parallel_sizes"):
        return {}
    levels = ps.get_hierarchical_context_parallel_groups()
    return {f"hierarchical_cp:{level}": group for level, group in enumerate(levels)}
