"""Megatron-LM (megatron-core ``parallel_state.initialize_model_parallel``): every group it builds.

Two ``RankGenerator`` grids share one order string (default ``tp-cp-ep-dp-pp``, fastest first):

* the decoder grid (tp, cp, dp, pp; ep = 1) gives ``dp``, ``dp-cp``, ``cp``, ``tp``, ``pp``,
  ``tp-pp``, ``tp-dp``, ``tp-dp-cp``, ``tp-cp`` and, from each pp group, ``embedding`` and
  ``position_embedding``;
* the expert grid (etp, ep, edp, pp; cp = 1) gives ``expert:ep``, ``expert:tp``,
  ``expert:tp-ep``, ``expert:tp-ep-pp`` and ``expert:dp``.

Partial distributed optimizer, hierarchical CP and hybrid DP×CP add kinds when configured.
``create_gloo_process_groups`` (megatron's default: True) adds the gloo twins ``dp-cp:gloo``,
``intra_dp_cp:gloo``, ``dp:gloo``, ``expert:dp:gloo`` and ``expert:intra_dp:gloo`` (same ranks as
the group they twin; their getters assert when the twins were not made), and
``create_all_gather_group`` adds ``dp-cp:ag``. ``hyper_comm_grid`` describes a
``HyperCommGrid`` built beside ``parallel_state`` and its ``create_pg`` calls (kinds
``hyper_comm_grid[KEY]``, see :mod:`._megatron_grid`).
Config checks follow upstream's order, each as a :class:`LayoutError` naming the exception
megatron-core raises. (The experimental ``gtp_remat`` axes are size 1 by default and not modelled.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown
from meshsim.model.conventions._megatron_config import Sizes, flag, validate
from meshsim.model.conventions._megatron_grid import grid_kinds, parse_spec
from meshsim.model.conventions._megatron_options import option_configs
from meshsim.model.conventions._megatron_ranks import (
    IntArray,
    RankGenerator,
    generate_masked_orthogonal_rank_groups,
    hierarchical_groups,
    hybrid_dp_cp_groups,
    hybrid_sizes,
)
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.sweep import divisors, ordered_factorizations

__all__ = [
    "DEFAULT_ORDER",
    "PARAMETERS",
    "PipelineRanks",
    "RankGenerator",
    "configs",
    "expect",
    "generate_masked_orthogonal_rank_groups",
    "grid_configs",
    "pipeline_ranks",
    "refused_configs",
]

DEFAULT_ORDER: Final = "tp-cp-ep-dp-pp"

PARAMETERS: Final[Mapping[str, str]] = {
    "tensor_model_parallel_size": "tensor-parallel degree (default 1)",
    "pipeline_model_parallel_size": "pipeline-parallel degree (default 1)",
    "context_parallel_size": "context-parallel degree (default 1)",
    "expert_model_parallel_size": "expert-parallel degree (default 1)",
    "expert_tensor_parallel_size": "tensor-parallel degree of experts (default: the dense TP)",
    "virtual_pipeline_model_parallel_size": "interleaved-schedule stages per rank (needs pp > 1)",
    "num_distributed_optimizer_instances": "partial distributed optimizer replicas (default 1)",
    "hierarchical_context_parallel_sizes": "CP split into levels, e.g. [2, 4] (product = CP)",
    "hybrid_context_parallel": "also build the hybrid DP×CP groups (default False)",
    "order": f"rank order, fastest axis first (default {DEFAULT_ORDER!r})",
    "get_embedding_ranks": "callable: pp group ranks -> ranks holding the word embedding",
    "get_position_embedding_ranks": "callable: pp group ranks -> ranks holding position embeddings",
    "create_gloo_process_groups": "also make the gloo twins of the dp-cp / dp / expert-dp groups "
    "(default True, as megatron)",
    "create_all_gather_group": "also make a second dp-cp group for all-gathers (default False)",
    "hyper_comm_grid": "a HyperCommGrid built beside: "
    '{"shape": [2, 4], "dim_names": ["tp", "dp"], "pgs": ["tp", ["tp", "dp"]], "rank_offset": 0}',
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "virtual_pipeline_model_parallel_size": "only checked (it needs pp > 1); "
    "initialize_model_parallel builds no group from it",
    "get_embedding_ranks": "a callable, which a sweep case cannot hold (cases are written to "
    "JSON and JUnit); tests/model/test_megatron.py and tests/real/test_megatron.py cover it",
    "get_position_embedding_ranks": "a callable, which a sweep case cannot hold (cases are "
    "written to JSON and JUnit); tests/model/test_megatron.py covers it",
}

#: Roles. ``loss`` is dp-cp: megatron's training loop all-reduces the loss sum and token count
#: over ``get_data_parallel_group(with_context_parallel=True)`` (CP ranks hold sequence chunks of
#: the same samples, so the loss of a sample is only complete over dp×cp).
ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dp",
    "gradient_reduce": "dp-cp",
    "tensor": "tp",
    "context": "cp",
    "pipeline": "pp",
    "embedding": "embedding",
    "loss": "dp-cp",
    "expert": "expert:ep",
    "expert_data": "expert:dp",
}

_DECODER_KINDS: Final[Mapping[str, str]] = {
    "dp-cp": "get_data_parallel_group(with_context_parallel=True): gradient reduce / DistOpt",
    "dp": "get_data_parallel_group(): data-parallel ranks (data loader), no CP",
    "cp": "get_context_parallel_group()",
    "tp-pp": "get_model_parallel_group()",
    "tp": "get_tensor_model_parallel_group()",
    "pp": "get_pipeline_model_parallel_group()",
    "tp-dp-cp": "get_tensor_and_data_parallel_group(with_context_parallel=True); FP8 amax",
    "tp-dp": "get_tensor_and_data_parallel_group(); FP8 amax reduction",
    "tp-cp": "get_tensor_and_context_parallel_group()",
}
_EXPERT_KINDS: Final[Mapping[str, str]] = {
    "ep": "get_expert_model_parallel_group()",
    "tp": "get_expert_tensor_parallel_group()",
    "tp-ep": "get_expert_tensor_and_model_parallel_group()",
    "tp-ep-pp": "get_expert_tensor_model_pipeline_parallel_group()",
    "dp": "get_expert_data_parallel_group(): expert DP (absorbs CP and any TP/ETP difference)",
}
#: The gloo twins: kind -> (the kind it twins, its getter).
_GLOO_TWINS: Final[Mapping[str, tuple[str, str]]] = {
    "dp-cp:gloo": ("dp-cp", "get_data_parallel_group_gloo(with_context_parallel=True)"),
    "intra_dp_cp:gloo": (
        "intra_dp_cp",
        "get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)",
    ),
    "dp:gloo": ("dp", "get_data_parallel_group_gloo()"),
    "expert:dp:gloo": ("expert:dp", "get_expert_data_parallel_group_gloo()"),
    "expert:intra_dp:gloo": (
        "expert:intra_dp",
        "get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)",
    ),
}

RanksFn = Callable[[list[int]], Sequence[int]]


def expect(world_size: int, **config: Any) -> Expected:
    """Every group ``initialize_model_parallel(**config)`` builds on ``world_size`` ranks.

    Example: ``expect(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)`` has dp
    groups ``(0, 2)``, ``(1, 3)``, ``(4, 6)``, ... and pp groups ``(0, 4, 8, 12)``, ...
    """
    reject_unknown("megatron", config, PARAMETERS)
    order = config.get("order", DEFAULT_ORDER)
    sizes, decoder, expert = validate(world_size, config, order)
    hcp: tuple[int, ...] = tuple(config.get("hierarchical_context_parallel_sizes") or ())
    hybrid = bool(config.get("hybrid_context_parallel", False))
    gloo = flag(config, "create_gloo_process_groups", True)
    all_gather = flag(config, "create_all_gather_group", False)
    grid = parse_spec(config["hyper_comm_grid"]) if config.get("hyper_comm_grid") else None

    def dense(token: str) -> Kind:
        return layout_kind(decoder.layout, token, _DECODER_KINDS[token], *decoder.dims(token))

    def dp_cp_groups() -> IntArray:
        return decoder.layout.groups_array(*decoder.dims("dp-cp"))

    def hybrid_family(size: int) -> Callable[[], IntArray]:
        return lambda: hybrid_dp_cp_groups(dp_cp_groups(), size)

    def cp_level(level: int) -> Callable[[], IntArray]:
        cp_dims = decoder.dims("cp")
        return lambda: hierarchical_groups(decoder.layout.groups_array(*cp_dims), hcp)[level]

    # Kinds in the order initialize_model_parallel creates them.
    kinds = [dense("dp-cp")]
    # Megatron 0.16.1 sets the partial groups even with one instance (then the whole dp-cp).
    width = sizes.dp * sizes.cp // sizes.instances
    kinds.append(
        _array_kind(
            "intra_dp_cp",
            "get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True): "
            "one distributed-optimizer instance's slice of dp-cp",
            lambda: dp_cp_groups().reshape(-1, width),
        )
    )
    if hybrid:
        kinds += [
            _array_kind(
                f"hybrid_dp_cp:{size}",
                f"get_hybrid_data_context_parallel_groups(group_size={size})",
                hybrid_family(size),
            )
            for size in hybrid_sizes(sizes.dp * sizes.cp)
        ]
    kinds += [dense("dp"), dense("cp")]
    if hcp:
        kinds += [
            _array_kind(
                f"hierarchical_cp:{level}",
                f"get_hierarchical_context_parallel_groups()[{level}] ({size} ranks each)",
                cp_level(level),
            )
            for level, size in enumerate(hcp)
        ]
    kinds += [dense("tp-pp"), dense("tp"), dense("pp")]
    kinds += _embedding_kinds(decoder, sizes.pp, config)
    kinds += [dense("tp-dp-cp"), dense("tp-dp"), dense("tp-cp")]
    kinds += [
        layout_kind(expert.layout, f"expert:{token}", description, *expert.dims(token))
        for token, description in _EXPERT_KINDS.items()
    ]
    kinds += _partial_expert_kinds(expert, sizes)
    kinds = _with_twins(kinds, gloo, all_gather)
    if grid is not None:  # built after initialize_model_parallel, so checked after it
        kinds += grid_kinds(world_size, grid)

    normal = {
        "tensor_model_parallel_size": sizes.tp,
        "pipeline_model_parallel_size": sizes.pp,
        "context_parallel_size": sizes.cp,
        "expert_model_parallel_size": sizes.ep,
        "expert_tensor_parallel_size": sizes.etp,
        "virtual_pipeline_model_parallel_size": config.get("virtual_pipeline_model_parallel_size"),
        "num_distributed_optimizer_instances": sizes.instances,
        "hierarchical_context_parallel_sizes": hcp or None,
        "hybrid_context_parallel": hybrid,
        "order": order,
        "create_gloo_process_groups": gloo,
        "create_all_gather_group": all_gather,
        "hyper_comm_grid": None if grid is None else grid.as_config(),
    }
    return Expected("megatron", world_size, normal, kinds, ROLES, layout=decoder.layout)


def _array_kind(
    name: str, description: str, build: Callable[[], IntArray], partition: bool = True
) -> Kind:
    return Kind(name, description, lambda: Groups.from_array(build()), partition=partition)


def _with_twins(kinds: list[Kind], gloo: bool, all_gather: bool) -> list[Kind]:
    """Each kind followed by the groups megatron makes beside it over the same ranks: the gloo
    twins and the all-gather dp-cp group. Twins not made are kinds whose getter asserts."""
    out: list[Kind] = []
    for kind in kinds:
        out.append(kind)
        if kind.name == "dp-cp":
            getter = (
                "get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)"
            )
            out.append(_twin(kind, "dp-cp:ag", getter, all_gather, "create_all_gather_group"))
        out += [
            _twin(kind, name, getter, gloo, "create_gloo_process_groups", backend="gloo")
            for name, (base, getter) in _GLOO_TWINS.items()
            if base == kind.name
        ]
    return out


def _twin(
    base: Kind, name: str, getter: str, made: bool, key: str, backend: str | None = None
) -> Kind:
    if not made:
        error = LayoutError(
            f"{getter} asserts: {key}=False, so megatron-core made no such group",
            upstream="AssertionError",
        )
        return Kind(name, f"{getter} (not made: {key}=False)", error)
    return Kind(
        name,
        f"{getter}: the ranks of {base.name}, a group of its own",
        base.groups,
        partition=base.partition,
        mesh_dims=base.mesh_dims,
        mesh_shape=base.mesh_shape,
        backends=(backend,),
    )


def _embedding_kinds(decoder: RankGenerator, pp: int, config: Mapping[str, Any]) -> list[Kind]:
    """``embedding`` and ``position_embedding``: picked from each pp group (first and last
    stage, and first stage, by default)."""
    pp_dims = decoder.dims("pp")

    def build(custom: RanksFn | None, columns: list[int]) -> Callable[[], IntArray]:
        def groups() -> IntArray:
            pipelines = decoder.layout.groups_array(*pp_dims)
            if custom is None:
                return pipelines[:, columns]
            picked = [list(custom([int(r) for r in row])) for row in pipelines]
            if len({len(p) for p in picked}) > 1:
                raise LayoutError(
                    "get_embedding_ranks returned groups of different sizes; "
                    "meshsim models equally sized groups only"
                )
            return np.array(picked, dtype=np.int64).reshape(len(picked), -1)

        return groups

    embedding_columns = [0] if pp == 1 else [0, pp - 1]
    custom_embedding = config.get("get_embedding_ranks")
    custom_position = config.get("get_position_embedding_ranks")
    return [
        _array_kind(
            "embedding",
            "get_embedding_group(): ranks tying word embedding and output layer per pipeline",
            build(custom_embedding, embedding_columns),
            partition=custom_embedding is None and len(embedding_columns) == pp,
        ),
        _array_kind(
            "position_embedding",
            "get_position_embedding_group(): ranks holding position embeddings per pipeline",
            build(custom_position, [0]),
            partition=custom_position is None and pp == 1,
        ),
    ]


def _partial_expert_kinds(expert: RankGenerator, sizes: Sizes) -> list[Kind]:
    """Partial distributed optimizer: expert DP split as hierarchical [edp/k, k], and the
    intra-instance group of consecutive expert tp-ep-pp groups."""
    k = sizes.instances
    edp_dims = expert.dims("dp")
    model_dims = expert.dims("tp-ep-pp")

    def levels() -> list[IntArray]:
        return hierarchical_groups(expert.layout.groups_array(*edp_dims), [sizes.edp // k, k])

    def instance() -> IntArray:
        # Upstream concatenates edp/k consecutive tp-ep-pp groups; torch's new_group sorts them.
        return np.sort(expert.layout.groups_array(*model_dims).reshape(k, -1), axis=1)

    intra = _array_kind(
        "expert:intra_dp",
        "get_expert_data_parallel_group(partial_expert_data_parallel=True): one instance's chunk",
        lambda: levels()[0],
    )
    whole = _array_kind(
        "intra_dist_opt_instance",
        "get_intra_distributed_optimizer_instance_group(): every rank of one optimizer instance",
        instance,
    )
    if k == 1:  # upstream: intra = the whole expert DP group, and no inter-instance group
        return [intra, whole]
    inter = _array_kind(
        "expert:inter_dp",
        "get_inter_distributed_optimizer_instance_group(): strided expert DP across instances",
        lambda: levels()[1],
    )
    return [intra, inter, whole]


@dataclass(frozen=True)
class PipelineRanks:
    """``get_pipeline_model_parallel_{first,last,next,prev}_rank()`` for one rank."""

    first: int
    last: int
    next: int
    prev: int


def pipeline_ranks(expected: Expected, rank: int) -> PipelineRanks:
    """The first, last, next and previous stage of ``rank``'s pipeline (next/prev wrap around).

    Example: world 8, tp 2, pp 4 (default order): rank 3 has first 1, last 7, next 5, prev 1.
    """
    group = expected.group_of(rank, "pipeline")
    if group is None:
        raise LayoutError(f"rank {rank} is in no pipeline group")
    prev, following = expected.pipeline_neighbors(rank)
    return PipelineRanks(first=group[0], last=group[-1], next=following, prev=prev)


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every tp×cp×pp (× ep × etp) config megatron-core accepts on ``world_size`` ranks.

    Options: ``orders`` (default ``tp-cp-ep-dp-pp`` and ``tp-cp-ep-pp-dp``), ``all_orders=True``
    for all 120 permutations, ``expert=False`` to keep ep = 1 and etp = tp. Configs that
    megatron-core rejects (e.g. a pp-not-last order with unequal dense and expert dp) are skipped.
    Then the options that change the groups, each over a few layouts, and further order strings
    (``_megatron_options.option_configs``; ``options=False`` leaves them out), and the
    :func:`grid_configs` (``hyper_comm_grid=False`` leaves them out); both are listed only with
    the default orders. World 8 gives 289 + 43 configs.
    """
    if options.get("all_orders"):
        orders: Sequence[str] = [
            "-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))
        ]
    else:
        orders = list(options.get("orders", (DEFAULT_ORDER, "tp-cp-ep-pp-dp")))
    with_expert = options.get("expert", True)
    first: list[dict[str, Any]] = []
    for order in orders:
        for tp, cp, pp, _dp in ordered_factorizations(world_size, 4):
            expert_sizes = [
                (ep, etp)
                for ep in divisors(world_size // pp)
                for etp in divisors(world_size // pp // ep)
            ]
            for ep, etp in expert_sizes if with_expert else [(1, tp)]:
                config: dict[str, Any] = {
                    "tensor_model_parallel_size": tp,
                    "context_parallel_size": cp,
                    "pipeline_model_parallel_size": pp,
                    "expert_model_parallel_size": ep,
                    "expert_tensor_parallel_size": etp,
                    "order": order,
                }
                try:
                    validate(world_size, config, order)
                except LayoutError:
                    continue
                if order == orders[0]:
                    first.append(config)
                yield config
    default_orders = "orders" not in options and not options.get("all_orders")
    if options.get("options", True) and default_orders:
        yield from option_configs(world_size, first, orders)
    if options.get("hyper_comm_grid", True) and default_orders:
        yield from grid_configs(world_size)


def grid_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """``HyperCommGrid`` configs: every tp×cp×dp×pp grid over the world with a ``create_pg``
    for each of its 15 dim subsets, beside ``initialize_model_parallel`` of the same sizes (so
    the grid's groups can be read against parallel_state's); then grids over the upper half of
    the world (``rank_offset``) with every 2-dim split, beside the default parallel_state.

    Each ``create_pg`` names its dims fastest first (a single dim as a string), so the grid
    must reorder them into its keys. Example (world 8): the first config is the grid
    ``[1, 1, 1, 8]`` over ``["tp", "cp", "dp", "pp"]``, whose ``["cp", "pp"]`` call is the kind
    ``hyper_comm_grid[pp-cp]``.
    """
    names = ("tp", "cp", "dp", "pp")
    subsets = [list(c) for n in range(1, 5) for c in itertools.combinations(names, n)]
    pgs = [dims[0] if len(dims) == 1 else dims for dims in subsets]
    for tp, cp, dp, pp in ordered_factorizations(world_size, 4):
        yield {
            "tensor_model_parallel_size": tp,
            "context_parallel_size": cp,
            "pipeline_model_parallel_size": pp,
            "order": DEFAULT_ORDER,
            "hyper_comm_grid": {"shape": [tp, cp, dp, pp], "dim_names": list(names), "pgs": pgs},
        }
    half = world_size // 2
    if world_size % 2:
        return
    for tp, dp in ordered_factorizations(half, 2):
        grid = {"shape": [tp, dp], "dim_names": ["tp", "dp"], "rank_offset": half}
        yield {"hyper_comm_grid": {**grid, "pgs": ["tp", "dp", ["dp", "tp"]]}}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs megatron-core refuses on ``world_size`` ranks: one per check of
    ``initialize_model_parallel`` and of ``HyperCommGrid`` that the world allows, for live
    runs to confirm the refusal and its exception type (each yielded config makes
    :func:`expect` raise a :class:`LayoutError` naming one)."""
    w = world_size
    tp, cp, pp, ep, etp = (
        "tensor_model_parallel_size",
        "context_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    )
    half = [2, w // 2]
    candidates: list[dict[str, Any]] = [
        {tp: w + 1},
        {"virtual_pipeline_model_parallel_size": 2},
        {tp: 2, ep: w},
        {"num_distributed_optimizer_instances": 3},
        {ep: w // 2, etp: 1, "num_distributed_optimizer_instances": 4},
        {tp: 2, pp: 2, cp: 2, "order": "tp-cp-pp-ep-dp"},
        {tp: 2, "order": "dp-pp"},
        {"order": "tp-xx-dp-pp"},
        {cp: 2, "hierarchical_context_parallel_sizes": [4]},
        {tp: w, "hybrid_context_parallel": True},
        {"hyper_comm_grid": {"shape": [w], "dim_names": ["a", "b"]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "rank_offset": -1}},
        {"hyper_comm_grid": {"shape": [2, w], "dim_names": ["a", "b"]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "pgs": [["a", "c"]]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "pgs": [[]]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "pgs": ["b", ["b"]]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "pgs": ["c"]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "b"], "pgs": [["a", "a"]]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["a", "a"], "pgs": ["a"]}},
        {"hyper_comm_grid": {"shape": half, "dim_names": ["_a", "b"], "pgs": ["b"]}},
    ]
    for config in candidates:
        try:
            expect(world_size, **config)
        except LayoutError as error:
            if error.upstream:
                yield config
