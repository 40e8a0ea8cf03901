"""Megatron-DeepSpeed (legacy ``parallel_state.initialize_model_parallel`` with Ulysses SP).

``variant`` picks the line of ``megatron/core/parallel_state.py`` modelled. Both lines build the
same groups; they differ in what the getters hand out:

* ``"upstream"`` (default): microsoft/Megatron-DeepSpeed, also HabanaAI's current branches.
  ``get_data_parallel_group()`` is the dp group *without* SP, ``get_sequence_data_parallel_group()``
  the sp × dp group, and tp / pp / embedding / amax / gloo-dp have getters of their own.
* ``"habana-2024"``: the 2024 Habana Labs fork. ``get_data_parallel_group()`` returns the sp × dp
  group; the tp / pp / embedding / amax / gloo-dp groups are module globals with no getter.

Ranks are laid out as Megatron order ``tp-sp-dp-pp``: row-major ``(pp, dp, sp, tp)``, where
DeepSpeed-Ulysses sequence parallelism (sp > 1) requires tp = pp = 1. Kinds:

* ``dp`` (``_DATA_PARALLEL_GROUP``, strided by tp or sp) and, with
  ``use_distributed_optimizer``, its gloo twin ``dp:gloo``; ``tp``, ``pp``, ``mp`` (tp × pp);
* ``sp`` (contiguous blocks of sp) and ``seq_dp`` (sp × dp: DeepSpeed's gradient-reduction /
  ZeRO group; the dp group itself when sp = 1);
* ``embedding`` / ``position_embedding`` from each pp group (with the encoder/decoder split rank);
* ``amax`` (contiguous blocks of tp × dp) when ``use_fp8``.

For dp, tp, pp, mp and amax this equals Megatron-LM order ``tp-dp-pp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.conventions import check, reject_unknown
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors, ordered_factorizations, spread

VARIANTS: Final = ("upstream", "habana-2024")

PARAMETERS: Final[Mapping[str, str]] = {
    "variant": "'upstream' (default: microsoft/Megatron-DeepSpeed) or 'habana-2024' (the 2024 "
    "Habana fork, whose get_data_parallel_group() is the SP × DP group)",
    "tensor_model_parallel_size": "tensor-parallel degree (default 1)",
    "pipeline_model_parallel_size": "pipeline-parallel degree (default 1)",
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence-parallel degree (needs tp = pp = 1)",
    "virtual_pipeline_model_parallel_size": "interleaved-schedule stages per rank (needs pp > 2)",
    "pipeline_model_parallel_split_rank": "first decoder stage of an encoder-decoder pipeline",
    "use_fp8": "also build the FP8 amax-reduction groups (default False)",
    "use_distributed_optimizer": "also build a gloo twin of each dp group (default False)",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "virtual_pipeline_model_parallel_size": "only checked (it needs pp > 2); "
    "initialize_model_parallel builds no group from it",
}

#: Roles per variant. Both feed DeepSpeed ``get_sequence_data_parallel_group()`` (seq_dp) for
#: gradients and ZeRO; the logged loss is averaged over ``get_data_parallel_group()``, which is
#: dp upstream and seq_dp in the Habana 2024 line.
_UPSTREAM_ROLES: Final[Mapping[str, str]] = {
    "data_parallel": "dp",
    "gradient_reduce": "seq_dp",
    "tensor": "tp",
    "context": "sp",
    "pipeline": "pp",
    "embedding": "embedding",
    "loss": "dp",
}
ROLES: Final[Mapping[str, Mapping[str, str]]] = {
    "upstream": _UPSTREAM_ROLES,
    "habana-2024": {**_UPSTREAM_ROLES, "loss": "seq_dp"},
}

#: kind -> what hands it out, per variant (the getter, or the module global it stays in).
DESCRIPTIONS: Final[Mapping[str, Mapping[str, str]]] = {
    "upstream": {
        "dp": "get_data_parallel_group(): data-parallel ranks, without SP",
        "dp:gloo": "get_data_parallel_group_gloo(): the ranks of dp, a gloo group of its own",
        "sp": "get_sequence_parallel_group(): Ulysses SP",
        "seq_dp": "get_sequence_data_parallel_group(): SP × DP, DeepSpeed's gradient/ZeRO group",
        "mp": "get_model_parallel_group(): tensor × pipeline",
        "tp": "get_tensor_model_parallel_group()",
        "pp": "get_pipeline_model_parallel_group()",
        "embedding": "get_embedding_group(): ranks tying input embedding and output layer",
        "position_embedding": "get_position_embedding_group(): ranks holding position embeddings",
        "amax": "get_amax_reduction_group(): FP8 amax over tensor × data parallel ranks",
    },
    "habana-2024": {
        "dp": "_DATA_PARALLEL_GROUP: data-parallel ranks without SP (no getter: "
        "get_data_parallel_group() returns seq_dp)",
        "dp:gloo": "_DATA_PARALLEL_GROUP_GLOO: the ranks of dp, a gloo group (no getter)",
        "sp": "get_sequence_parallel_group(): Ulysses SP",
        "seq_dp": "get_sequence_data_parallel_group() = get_data_parallel_group(): SP × DP",
        "mp": "get_model_parallel_group(): tensor × pipeline",
        "tp": "_TENSOR_MODEL_PARALLEL_GROUP (no getter in this line)",
        "pp": "_PIPELINE_MODEL_PARALLEL_GROUP (no getter in this line)",
        "embedding": "_EMBEDDING_GROUP: ranks tying input embedding and output layer (no getter)",
        "position_embedding": "_POSITION_EMBEDDING_GROUP: ranks holding position embeddings "
        "(no getter)",
        "amax": "_AMAX_REDUCTION_GROUP: FP8 amax over tensor × data parallel ranks (no getter)",
    },
}


def expect(world_size: int, **config: Any) -> Expected:
    """Every group ``initialize_model_parallel(**config)`` builds, named per ``variant``.

    Example: ``expect(8, sequence_parallel_size=2)`` has dp groups ``(0, 2, 4, 6)``,
    ``(1, 3, 5, 7)`` (upstream's ``get_data_parallel_group()``) and the single seq_dp group of
    all 8 ranks (``get_data_parallel_group()`` with ``variant="habana-2024"``).
    """
    reject_unknown("megatron-deepspeed", config, PARAMETERS)
    checked = validate(world_size, config)
    variant, tp, pp, sp, dp, split = dataclasses.astuple(checked)
    vpp = config.get("virtual_pipeline_model_parallel_size")
    use_fp8 = bool(config.get("use_fp8", False))
    gloo = bool(config.get("use_distributed_optimizer", False))
    layout = Layout(pp=pp, dp=dp, sp=sp, tp=tp)
    said = DESCRIPTIONS[variant]

    def kind(name: str, *dims: str) -> Kind:
        return layout_kind(layout, name, said[name], *dims)

    kinds = [kind("dp", "dp"), *_gloo_twin(layout, variant, gloo)]
    kinds += [kind("sp", "sp"), kind("seq_dp", "dp", "sp"), kind("mp", "pp", "tp")]
    kinds += [kind("tp", "tp"), kind("pp", "pp"), *_embedding_kinds(layout, pp, split, said)]
    if use_fp8:

        def blocks() -> Groups:  # contiguous tp × dp blocks, whatever the mesh
            return Groups(np.arange(world_size, dtype=np.int64).reshape(-1, tp * dp))

        kinds.append(Kind("amax", said["amax"], blocks))
    elif variant == "upstream":  # the getter asserts; the Habana line has none to ask
        kinds.append(_not_made("amax", "get_amax_reduction_group()", "use_fp8"))
    normal = {
        "variant": variant,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "sequence_parallel_size": sp,
        "virtual_pipeline_model_parallel_size": vpp,
        "pipeline_model_parallel_split_rank": split,
        "use_fp8": use_fp8,
        "use_distributed_optimizer": gloo,
    }
    roles = ROLES[variant]
    return Expected("megatron-deepspeed", world_size, normal, kinds, roles, layout=layout)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config past ``initialize_model_parallel``'s checks: variant, degrees, split rank."""

    variant: str
    tp: int
    pp: int
    sp: int
    dp: int
    split: int | None


def validate(world_size: int, config: Mapping[str, Any]) -> Checked:
    """``initialize_model_parallel``'s checks of ``config``, in its order, and the data-parallel
    degree they leave: world 8, ``sequence_parallel_size=2`` gives dp 4."""
    variant = config.get("variant", "upstream")
    if variant not in VARIANTS:
        raise LayoutError(
            f"unknown megatron-deepspeed variant {variant!r}; variants are {VARIANTS}"
        )
    tp = _degree(config, "tensor_model_parallel_size")
    pp = _degree(config, "pipeline_model_parallel_size")
    sp = _degree(config, "sequence_parallel_size")
    vpp = config.get("virtual_pipeline_model_parallel_size")
    split = config.get("pipeline_model_parallel_split_rank")
    if split is not None and (isinstance(split, bool) or not isinstance(split, (int, np.integer))):
        raise LayoutError(f"pipeline_model_parallel_split_rank must be an integer, got {split!r}")
    split = None if split is None else int(split)
    dp = _validate(world_size, tp, pp, sp, vpp, split)
    return Checked(variant, tp, pp, sp, dp, split)


def _degree(config: Mapping[str, Any], key: str) -> int:
    """Any integer: 0 and negative degrees get upstream's own arithmetic (see ``_validate``)."""
    value = config.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{key} must be an integer, got {value!r}")
    return int(value)


def _validate(world: int, tp: int, pp: int, sp: int, vpp: Any, split: int | None) -> int:
    """The data-parallel degree, or what ``initialize_model_parallel`` raises, in its order.

    Both lines run the same checks and the same integer arithmetic, so a 0 degree divides by
    zero and a negative one makes ``range(world_size // size)`` empty: the call returns, but
    with groups missing, and the first getter that needs one fails its assert (or, when the
    model-parallel loop still runs, torch refuses its ``new_group([])``).
    """
    check(
        tp * pp != 0,
        f"tensor_model_parallel_size ({tp}) × pipeline_model_parallel_size ({pp}) is 0: "
        f"world_size % 0 divides by zero",
        "ZeroDivisionError",
    )
    check(
        world % (tp * pp) == 0,
        f"world_size {world} is not divisible by tensor_model_parallel_size ({tp}) × "
        f"pipeline_model_parallel_size ({pp}) = {tp * pp}",
        "RuntimeError",
    )
    check(
        sp <= 1 or (tp == 1 and pp == 1),
        f"DeepSpeed sequence parallelism (sequence_parallel_size={sp}) works only with "
        f"tensor and pipeline parallel size 1, got tp={tp}, pp={pp}",
        "AssertionError",
    )
    check(
        sp <= 1 or world % sp == 0,
        f"world_size {world} is not divisible by sequence_parallel_size {sp}",
        "RuntimeError",
    )
    if sp == 0 or world // (tp * pp * sp) == 0:
        raise LayoutError(
            f"the data-parallel degree world_size // (tp × pp × sp) = {world} // ({tp} × {pp} × "
            f"{sp}) is {'undefined' if sp == 0 else 0}: initialize_model_parallel divides by it",
            upstream="ZeroDivisionError",
        )
    if vpp is not None and not pp > 2:
        raise LayoutError(
            f"virtual_pipeline_model_parallel_size={vpp} (interleaved schedule) needs "
            f"pipeline_model_parallel_size > 2 in Megatron-DeepSpeed, got {pp}",
            upstream="RuntimeError",
        )
    dp = world // (tp * pp * sp)
    if min(tp, pp) < 0 and dp > 0:
        raise LayoutError(
            f"tp={tp}, pp={pp}, sp={sp}: range() over a negative degree builds no data-parallel "
            f"group, so each of the {dp} model-parallel groups is new_group([]), which torch "
            "refuses",
            upstream="TypeError",
        )
    if split is not None and pp > 1 and not -pp <= split < pp:
        raise LayoutError(
            f"pipeline_model_parallel_split_rank={split} is not a stage of a {pp}-stage pipeline "
            f"(valid: 0..{pp - 1})",
            upstream="IndexError",
        )
    if min(tp, pp) < 0:
        raise LayoutError(
            f"a negative degree (tp={tp}, pp={pp}) leaves range() empty: "
            "initialize_model_parallel returns without building the data-parallel groups, and "
            "get_data_parallel_group() fails its assert",
            upstream="AssertionError",
        )
    if sp < 0:
        raise LayoutError(
            f"sequence_parallel_size={sp} leaves range(world_size // {sp}) empty: "
            "initialize_model_parallel returns without building the sequence-parallel groups, "
            "and get_sequence_parallel_group() fails its assert",
            upstream="AssertionError",
        )
    return dp


def _gloo_twin(layout: Layout, variant: str, made: bool) -> list[Kind]:
    """``dp:gloo``: each dp group again on gloo, under ``use_distributed_optimizer`` (in both
    lines it twins the dp group without SP). Not made, upstream's getter asserts; the Habana
    line has no getter, so there is nothing to ask for."""
    if made:
        description = DESCRIPTIONS[variant]["dp:gloo"]
        return [layout_kind(layout, "dp:gloo", description, "dp", backends=("gloo",))]
    if variant == "habana-2024":
        return []
    return [_not_made("dp:gloo", "get_data_parallel_group_gloo()", "use_distributed_optimizer")]


def _not_made(name: str, getter: str, flag: str) -> Kind:
    """A kind ``initialize_model_parallel`` makes only under ``flag``: without it upstream's
    getter asserts (its group is still None)."""
    error = LayoutError(
        f"{getter} asserts: {flag}=False, so initialize_model_parallel made no such group",
        upstream="AssertionError",
    )
    return Kind(name, f"{getter} (not made: {flag}=False)", error)


def _embedding_kinds(
    layout: Layout, pp: int, split: int | None, said: Mapping[str, str]
) -> list[Kind]:
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
        Kind("embedding", said["embedding"], pick(embedding), partition=len(embedding) == pp),
        Kind(
            "position_embedding",
            said["position_embedding"],
            pick(position),
            partition=len(position) == pp,
        ),
    ]


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Per variant: every tp × pp config (sp = 1), then every sp > 1 config (tp = pp = 1);
    then, over a few of those (:func:`~meshsim.model.sweep.spread`), the options that change
    the groups: ``pipeline_model_parallel_split_rank`` 1 (a middle stage joins the embedding
    groups from pp = 3 on) and both flags at their default, False.

    Options: ``variant`` (default: both), ``use_fp8`` and ``use_distributed_optimizer``
    (default True, so sweeps cover the amax groups and the gloo twins). World 8 gives 32.
    """
    variants = (options["variant"],) if "variant" in options else VARIANTS
    flags = {
        "use_fp8": bool(options.get("use_fp8", True)),
        "use_distributed_optimizer": bool(options.get("use_distributed_optimizer", True)),
    }
    for variant in variants:
        listed: list[dict[str, Any]] = []
        for tp, pp, _dp in ordered_factorizations(world_size, 3):
            listed.append(
                {
                    "variant": variant,
                    "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp,
                    **flags,
                }
            )
        for sp in divisors(world_size)[1:]:
            listed.append({"variant": variant, "sequence_parallel_size": sp, **flags})
        yield from listed
        axes = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        # A middle stage (pp > 2) changes both embedding groups; at pp = 2 it is the last one.
        staged = [c for c in listed if c.get("pipeline_model_parallel_size", 1) > 2] or [
            c for c in listed if c.get("pipeline_model_parallel_size", 1) > 1
        ]
        for config in spread(staged, axes):
            yield {**config, "pipeline_model_parallel_split_rank": 1}
        off = {key: False for key in flags}
        if any(flags.values()):
            yield from ({**c, **off} for c in spread(listed, (*axes, "sequence_parallel_size")))


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs both lines reject, per variant, each with the type ``expect`` names as
    ``upstream``: a 0 degree (ZeroDivisionError), a tp that does not divide the world
    (RuntimeError), Ulysses SP beside tp (AssertionError), interleaving with pp = 2
    (RuntimeError), a split rank past the last stage (IndexError), negative degrees (the
    getter's AssertionError)."""
    odd = next(n for n in range(2, world_size + 2) if world_size % n)
    for variant in VARIANTS:
        base = {"variant": variant}
        yield {**base, "tensor_model_parallel_size": 0}
        yield {**base, "sequence_parallel_size": 0}
        yield {**base, "tensor_model_parallel_size": odd}
        yield {**base, "sequence_parallel_size": odd}
        yield {**base, "tensor_model_parallel_size": -1}
        yield {**base, "sequence_parallel_size": -1}
        if world_size % 4 == 0:
            yield {**base, "tensor_model_parallel_size": 2, "sequence_parallel_size": 2}
        if world_size % 2 == 0:
            pipeline = {"pipeline_model_parallel_size": 2}
            yield {**base, **pipeline, "virtual_pipeline_model_parallel_size": 2}
            yield {**base, **pipeline, "pipeline_model_parallel_split_rank": 2}
