"""Megatron-DeepSpeed (legacy ``parallel_state.initialize_model_parallel`` with Ulysses SP).

Ranks are laid out as Megatron order ``tp-sp-dp-pp``: row-major ``(pp, dp, sp, tp)``, where
DeepSpeed-Ulysses sequence parallelism (sp > 1) requires tp = pp = 1. Kinds:

* ``dp`` (``_DATA_PARALLEL_GROUP``, strided by tp or sp), ``tp``, ``pp``, ``mp`` (tp × pp);
* ``sp`` (contiguous blocks of sp) and ``seq_dp`` (sp × dp: the gradient-reduction / ZeRO group;
  it aliases ``dp`` when sp = 1). Note that this file's ``get_data_parallel_group()`` returns
  the ``seq_dp`` group;
* ``embedding`` / ``position_embedding`` from each pp group (with the encoder/decoder split rank);
* ``amax`` (contiguous blocks of tp × dp) when ``use_fp8``.

For dp, tp, pp, mp and amax this equals Megatron-LM order ``tp-dp-pp``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations

PARAMETERS: Final[Mapping[str, str]] = {
    "tensor_model_parallel_size": "tensor-parallel degree (default 1)",
    "pipeline_model_parallel_size": "pipeline-parallel degree (default 1)",
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence-parallel degree (needs tp = pp = 1)",
    "virtual_pipeline_model_parallel_size": "interleaved-schedule stages per rank (needs pp > 2)",
    "pipeline_model_parallel_split_rank": "first decoder stage of an encoder-decoder pipeline",
    "use_fp8": "also build the FP8 amax-reduction groups (default False)",
    "use_distributed_optimizer": "also build gloo DP groups (same ranks; default False)",
}

#: Roles: ``seq_dp`` reduces gradients and is where the loss is averaged, as Megatron's dp-cp.
ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dp",
    "gradient_reduce": "seq_dp",
    "tensor": "tp",
    "context": "sp",
    "pipeline": "pp",
    "embedding": "embedding",
    "loss": "seq_dp",
}


def expect(world_size: int, **config: Any) -> Expected:
    """Every group the seed's ``initialize_model_parallel(**config)`` builds.

    Example: ``expect(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)`` has dp
    groups ``(0, 2)``, ``(1, 3)``, ``(4, 6)``, ..., tp groups ``(0, 1)``, ``(2, 3)``, ... and pp
    groups ``(0, 4, 8, 12)``, ``(1, 5, 9, 13)``, ...
    """
    reject_unknown("megatron-deepspeed", config, PARAMETERS)
    tp = _degree(config, "tensor_model_parallel_size")
    pp = _degree(config, "pipeline_model_parallel_size")
    sp = _degree(config, "sequence_parallel_size")
    vpp = config.get("virtual_pipeline_model_parallel_size")
    split = config.get("pipeline_model_parallel_split_rank")
    use_fp8 = bool(config.get("use_fp8", False))

    if world_size % (tp * pp):
        raise LayoutError(
            f"world_size {world_size} is not divisible by tensor_model_parallel_size ({tp}) × "
            f"pipeline_model_parallel_size ({pp}) = {tp * pp}",
            upstream="RuntimeError",
        )
    if sp > 1 and (tp != 1 or pp != 1):
        raise LayoutError(
            f"DeepSpeed sequence parallelism (sequence_parallel_size={sp}) works only with "
            f"tensor and pipeline parallel size 1, got tp={tp}, pp={pp}",
            upstream="AssertionError",
        )
    if sp > 1 and world_size % sp:
        raise LayoutError(
            f"world_size {world_size} is not divisible by sequence_parallel_size {sp}",
            upstream="RuntimeError",
        )
    if vpp is not None and not pp > 2:
        raise LayoutError(
            f"virtual_pipeline_model_parallel_size={vpp} (interleaved schedule) needs "
            f"pipeline_model_parallel_size > 2 in Megatron-DeepSpeed, got {pp}",
            upstream="RuntimeError",
        )
    if split is not None and (isinstance(split, bool) or not isinstance(split, (int, np.integer))):
        raise LayoutError(f"pipeline_model_parallel_split_rank must be an integer, got {split!r}")
    split = None if split is None else int(split)
    if split is not None and pp > 1 and not -pp <= split < pp:
        raise LayoutError(
            f"pipeline_model_parallel_split_rank={split} is not a stage of a {pp}-stage pipeline "
            f"(valid: 0..{pp - 1})",
            upstream="IndexError",
        )
    dp = world_size // (tp * pp * sp)
    layout = Layout(pp=pp, dp=dp, sp=sp, tp=tp)

    kinds = [
        layout_kind(layout, "dp", "_DATA_PARALLEL_GROUP: data-parallel ranks, no SP", "dp"),
        layout_kind(layout, "sp", "get_sequence_parallel_group(): Ulysses SP", "sp"),
        layout_kind(
            layout,
            "seq_dp",
            "get_sequence_data_parallel_group() (= get_data_parallel_group()): SP × DP",
            "dp",
            "sp",
        ),
        layout_kind(layout, "mp", "get_model_parallel_group(): tensor × pipeline", "pp", "tp"),
        layout_kind(layout, "tp", "get_tensor_model_parallel_group()", "tp"),
        layout_kind(layout, "pp", "get_pipeline_model_parallel_group()", "pp"),
        *_embedding_kinds(layout, pp, split),
    ]
    if use_fp8:
        kinds.append(
            Kind(
                "amax",
                "get_amax_reduction_group(): FP8 amax over tensor × data parallel ranks",
                lambda: Groups(np.arange(world_size, dtype=np.int64).reshape(-1, tp * dp)),
            )
        )
    normal = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "sequence_parallel_size": sp,
        "virtual_pipeline_model_parallel_size": vpp,
        "pipeline_model_parallel_split_rank": split,
        "use_fp8": use_fp8,
        "use_distributed_optimizer": bool(config.get("use_distributed_optimizer", False)),
    }
    return Expected("megatron-deepspeed", world_size, normal, kinds, ROLES, layout=layout)


def _degree(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)


def _embedding_kinds(layout: Layout, pp: int, split: int | None) -> list[Kind]:
    """[first, last] (position: [first]) of each pp group, plus the split stage when it is set
    and not already there; with pp = 1 both are the single rank."""
    embedding, position = ([0], [0]) if pp == 1 else ([0, pp - 1], [0])
    if split is not None and pp > 1:
        stage = split % pp  # upstream indexes the pp group with it, so negatives count back
        if stage not in embedding:
            embedding = [0, stage, pp - 1]
        if stage not in position:
            position = [0, stage]

    def pick(columns: list[int]) -> Callable[[], Groups]:
        return lambda: Groups(layout.groups_array("pp")[:, columns])

    return [
        Kind(
            "embedding",
            "get_embedding_group(): ranks tying input embedding and output layer",
            pick(embedding),
            partition=len(embedding) == pp,
        ),
        Kind(
            "position_embedding",
            "get_position_embedding_group(): ranks holding position embeddings",
            pick(position),
            partition=len(position) == pp,
        ),
    ]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every tp × pp config (sp = 1), then every sp > 1 config (tp = pp = 1).

    Option ``use_fp8`` (default True, so sweeps cover the amax groups).
    """
    use_fp8 = bool(options.get("use_fp8", True))
    for tp, pp, _dp in ordered_factorizations(world_size, 3):
        yield {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "use_fp8": use_fp8,
        }
    for sp in divisors(world_size)[1:]:
        yield {"sequence_parallel_size": sp, "use_fp8": use_fp8}
