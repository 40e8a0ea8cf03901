"""DeepSpeed AutoEP + AutoTP folding (``deepspeed.module_inject.auto_ep_folding``, 0.19.8).

The engine's ``_configure_expert_parallel`` turns the config into a ``ParallelFoldingSpec`` with
``build_folding_spec(world_size=, pp_size=, tp_size=, ep_size=, etp_size=, mp_mode=)``, vets it
with ``validate_folding_global`` and creates the groups; ``expected_folding_group_tables`` is
DeepSpeed's own statement of which ranks they hold. Every pipeline stage (``world / pp_size``
consecutive ranks) is folded twice:

* dense view ``(dense_dp, tp)``, tp fastest: ``tp`` is AutoTP's
  ``groups.get_tensor_model_parallel_group()`` (``_init_tp_mesh_device``), ``dense_dp`` the
  engine's ``groups._get_data_parallel_group()``, the TP lanes strided by ``tp_size``;
* expert view ``(edp, ep)``, ep fastest: ``ep`` / ``edp`` are the ``ep_size_<n>`` groups of
  ``groups._create_expert_and_data_parallel``: consecutive runs of ``ep_size`` ranks, and the
  ranks at one position of every run. An EP group may span TP lanes (cross-lane EP).

With ``tp_size == 1`` the engine builds no TP group at all (no AutoTP mesh, no
``FoldingGroupHandles``), so ``tp`` is unavailable; the expert groups then come from the legacy
path of ``_create_expert_and_data_parallel``, which yields the same tables.

Roles follow ``autoep_folding_gradient_reduction_strategy``: TP peers see the same tokens (the
engine checks that their inputs agree), so ``dense_dp`` loads distinct data and reduces dense,
router and LayerNorm gradients (their TP reduction is an AVERAGE over identical replicas, no
data-parallel sum); routed experts (``allreduce=False``) are not TP-reduced at all (only divided
by ``tp_size``) and reduce over ``edp``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions import check, reject_unknown
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors

__all__ = ["PARAMETERS", "configs", "expect", "refused_configs"]

FRAMEWORK: Final = "deepspeed-autoep"

PARAMETERS: Final[Mapping[str, str]] = {
    "pp_size": "pipeline stages (the mpu's pipeline world size; 1 without an mpu; default 1)",
    "tp_size": "tensor_parallel.autotp_size (the engine passes max(autotp_size, 1); default 1)",
    "ep_size": "expert_parallel.autoep_size: ranks per expert-parallel group (default 1)",
    "etp_size": "expert_parallel.expert_tensor_parallel_size (default 1; only 1 is supported)",
    "mp_mode": "'tp' (build_folding_spec's default) or 'sp'; the engine passes 'tp' when "
    "tp_size > 1 else 'sp'. It picks gradient strategies, never groups",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "etp_size": "DeepSpeed takes 1 only (validate_folding_global refuses any other; "
    "refused_configs lists it)",
}

#: ``build_folding_spec`` names the sizes by their config paths in its messages.
_CONFIG_PATH: Final[Mapping[str, str]] = {
    "pp_size": "pp_size",
    "tp_size": "tensor_parallel.autotp_size",
    "ep_size": "expert_parallel.autoep_size",
    "etp_size": "expert_parallel.expert_tensor_parallel_size",
}

_ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dense_dp",
    "gradient_reduce": "dense_dp",
    "tensor": "tp",
    "expert": "ep",
    "expert_data": "edp",
}


def expect(world_size: int, **config: Any) -> Expected:
    """The folding groups of ``config``, or the ``ValueError`` DeepSpeed raises for it.

    Example: ``expect(8, tp_size=2, ep_size=4)`` has tp ``(0, 1)``, ``(2, 3)``, ... dense_dp
    ``(0, 2, 4, 6)``, ``(1, 3, 5, 7)``, ep ``(0, 1, 2, 3)``, ``(4, 5, 6, 7)`` and edp ``(0, 4)``,
    ``(1, 5)``, ``(2, 6)``, ``(3, 7)``.
    """
    reject_unknown(FRAMEWORK, config, PARAMETERS)
    sizes = engine_sizes(config)
    mp_mode = config.get("mp_mode", "tp")
    stage = _build_folding_spec(world_size, **sizes)
    sizes = {key: int(value) for key, value in sizes.items()}  # True is 1 to DeepSpeed
    _validate_folding_global(**sizes)
    pp, tp, ep = sizes["pp_size"], sizes["tp_size"], sizes["ep_size"]
    dense = Layout([("pp", pp), ("dense_dp", stage // tp), ("tp", tp)])
    expert = Layout([("pp", pp), ("edp", stage // ep), ("ep", ep)])
    kinds = [
        _tp_kind(dense, tp),
        layout_kind(
            dense,
            "dense_dp",
            "groups._get_data_parallel_group(): dense data parallel, TP lanes strided by tp_size "
            "(reduces dense, router and LayerNorm gradients)",
            "dense_dp",
        ),
        layout_kind(
            expert,
            "ep",
            "groups._get_expert_parallel_group('ep_size_<ep_size>'): consecutive ranks of a stage "
            "(the expert all-to-all)",
            "ep",
        ),
        layout_kind(
            expert,
            "edp",
            "groups._get_expert_data_parallel_group('ep_size_<ep_size>'): one position of every EP "
            "group (reduces routed-expert gradients)",
            "edp",
        ),
    ]
    roles = {role: kind for role, kind in _ROLES.items() if kind != "tp" or tp > 1}
    normal = {**sizes, "mp_mode": mp_mode}
    return Expected(
        FRAMEWORK, world_size, normal, kinds, roles, layout=dense, meshes={"expert": expert}
    )


def engine_sizes(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes the engine hands ``build_folding_spec``: each key's value (default 1), with
    ``tp_size`` as ``max(autotp_size, 1)`` (``engine.py`` and ``validate_autoep_config`` both
    clamp it: AutoTP's own default 0, or any size below 1, means no AutoTP)."""
    sizes = {key: config.get(key, 1) for key in _CONFIG_PATH}
    tp = sizes["tp_size"]
    if isinstance(tp, int) and tp < 1:
        sizes["tp_size"] = 1
    return sizes


def _tp_kind(dense: Layout, tp: int) -> Kind:
    if tp > 1:
        return layout_kind(
            dense,
            "tp",
            "groups.get_tensor_model_parallel_group(): AutoTP's consecutive tp_size ranks "
            "(same tokens; AVERAGE of replicated gradients)",
            "tp",
        )
    return Kind(
        "tp",
        "groups.get_tensor_model_parallel_group()",
        LayoutError(
            "tp_size 1 builds no TP group: the engine runs AutoTP's _init_tp_mesh_device and "
            "builds FoldingGroupHandles only for tensor_parallel.autotp_size > 1"
        ),
    )


def _build_folding_spec(world_size: int, **sizes: Any) -> int:
    """``build_folding_spec`` 's checks, in its order; the stage size."""
    for key, path in _CONFIG_PATH.items():
        value = sizes[key]
        # Its test is isinstance(value, int): bools pass, numpy integers do not.
        if not isinstance(value, int) or value < 1:
            raise LayoutError(
                f"{path} must be a positive integer, got {value!r}", upstream="ValueError"
            )
    pp, tp, ep, etp = (sizes[k] for k in _CONFIG_PATH)
    check(
        world_size % pp == 0,
        f"pp_size={pp} must divide world_size={world_size} (build_folding_spec)",
        "ValueError",
    )
    stage = world_size // pp
    check(
        stage % tp == 0,
        f"tensor_parallel.autotp_size={tp} must divide the stage size {stage} "
        "(build_folding_spec: dense dp would be non-integral)",
        "ValueError",
    )
    check(
        stage % (ep * etp) == 0,
        f"autoep_size * expert_tensor_parallel_size ({ep} * {etp}) must divide the stage "
        f"size {stage} (build_folding_spec: edp would be non-integral)",
        "ValueError",
    )
    return stage


def _validate_folding_global(**sizes: Any) -> None:
    """``validate_folding_global`` 's structural checks (the engine's other inputs at their
    defaults: no DeepCompile, no Ulysses SP, E + D order, no ZeRO offload, no mpu TP)."""
    pp, tp, ep, etp = (sizes[k] for k in _CONFIG_PATH)
    if tp > 1 and pp > 1:
        raise LayoutError(
            f"AutoEP+AutoTP folding supports pp_size=1 only, got pp_size={pp} with "
            f"autotp_size={tp} (validate_folding_global)",
            upstream="ValueError",
        )
    if etp != 1:
        raise LayoutError(
            f"expert_tensor_parallel_size={etp} is not supported yet, only 1 "
            "(validate_folding_global)",
            upstream="ValueError",
        )
    if tp > 1 and ep == 1:
        raise LayoutError(
            "AutoEP+AutoTP folding needs autoep_size > 1 when autotp_size > 1 "
            "(validate_folding_global)",
            upstream="ValueError",
        )


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every spec the folding path accepts: each ``pp_size`` dividing the world and each
    ``ep_size`` dividing a stage with ``tp_size`` 1, then (``pp_size`` 1) each ``tp_size > 1``
    with each ``ep_size > 1``; ``mp_mode`` as the engine derives it. World 8 gives 19."""
    for pp in divisors(world_size):
        for ep in divisors(world_size // pp):
            yield {"pp_size": pp, "tp_size": 1, "ep_size": ep, "etp_size": 1, "mp_mode": "sp"}
    for tp in divisors(world_size)[1:]:
        for ep in divisors(world_size)[1:]:
            yield {"pp_size": 1, "tp_size": tp, "ep_size": ep, "etp_size": 1, "mp_mode": "tp"}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Specs DeepSpeed refuses, all with ``ValueError``: a size below 1, a ``pp_size`` not
    dividing the world, a ``tp_size`` or ``ep_size * etp_size`` not dividing a stage
    (``build_folding_spec``), and ``tp_size > 1`` with ``pp_size > 1``, any ``etp_size != 1``,
    ``tp_size > 1`` with ``ep_size == 1`` (``validate_folding_global``)."""
    yield {"pp_size": 1, "tp_size": 1, "ep_size": -1}
    yield {"pp_size": 0, "tp_size": 1, "ep_size": 1}
    yield {"pp_size": world_size + 1, "tp_size": 1, "ep_size": 1}
    yield {"pp_size": 1, "tp_size": world_size + 1, "ep_size": 2}
    yield {"pp_size": 1, "tp_size": 1, "ep_size": world_size + 1}
    if world_size % 2 == 0:
        yield {"pp_size": 1, "tp_size": 1, "ep_size": world_size, "etp_size": 2}
        yield {"pp_size": 1, "tp_size": 1, "ep_size": 1, "etp_size": 2}
        yield {"pp_size": 1, "tp_size": 2, "ep_size": 1}
    if world_size % 4 == 0:
        yield {"pp_size": 2, "tp_size": 2, "ep_size": 2}
        yield {"pp_size": 1, "tp_size": 2, "ep_size": 2, "etp_size": 2}
