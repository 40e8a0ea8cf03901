"""AReaL 1.0.4's FSDP engine mesh: ``ParallelHelper.build_mesh`` (``areal/engine/fsdp_utils``).

``FSDPEngine.create_process_group`` turns its ``ParallelStrategy`` into an
``FSDPParallelStrategy`` and hands it to ``ParallelHelper.from_parallel_strategy``, whose
``build_mesh`` calls ``init_device_mesh`` over ``(dp, sp, tp)`` (the strategy's data, context and
tensor degrees), size-1 dims kept, and flattens ``dp_sp`` (the FSDP mesh) and ``sp_tp`` (the
engine's model-parallel group, whose first rank is the data-parallel head). With
``expert_parallel_size > 1`` the root is ``(dp_mod_ep, dp_in_ep, sp, tp)`` instead, ``dp`` becomes
a flattened dim, and ``ep`` is flattened from ``dp_in_ep x sp`` (x ``tp`` when
``expert_tensor_parallel_size`` is 1). AReaL's own checks are ``assert`` statements, so its
refusals are ``AssertionError``; a strategy whose product is not the world fails in torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown, upstream_error
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import above_one, divisors, ordered_factorizations

PARAMETERS: Final[Mapping[str, str]] = {
    "data_parallel_size": "ParallelStrategy.data_parallel_size (default 1): the 'dp' degree",
    "context_parallel_size": "ParallelStrategy.context_parallel_size (default 1): the 'sp' "
    "(Ulysses) degree",
    "tensor_parallel_size": "ParallelStrategy.tensor_parallel_size (default 1): the 'tp' degree",
    "pipeline_parallel_size": "ParallelStrategy.pipeline_parallel_size (default 1; FSDP refuses "
    "any other)",
    "expert_parallel_size": "ParallelStrategy.expert_parallel_size (default 1; > 1 builds the "
    "dp_mod_ep/dp_in_ep mesh)",
    "expert_tensor_parallel_size": "ParallelStrategy.expert_tensor_parallel_size (default 1; "
    "with EP it must be 1 or tensor_parallel_size)",
}
#: Config keys every sweep case leaves at their default, each with why (``sweep.fixed_options``).
SWEEP_FIXED: Final[Mapping[str, str]] = {
    "pipeline_parallel_size": "the FSDP engine refuses any value but 1 (refused_configs lists it)",
}

_KEYS: Final = tuple(PARAMETERS)
_PURPOSES: Final[Mapping[str, str]] = {
    "dp": "data parallel: ParallelHelper.dp_group = FSDPEngine.data_parallel_group (batch split, "
    "loss-weight all-reduce)",
    "sp": "Ulysses sequence parallel (context_parallel_size): FSDPEngine.sp_group",
    "tp": "tensor parallel: ParallelHelper.tp_group, the TP plan's mesh, grad-norm tp_group",
    "dp_mod_ep": "data-parallel ranks across expert-parallel groups",
    "dp_in_ep": "data-parallel ranks inside one expert-parallel group",
    "dp_sp": "the fully_shard mesh and the grad-norm fsdp_group",
    "sp_tp": "FSDPEngine.mp_group; its first rank is the data-parallel head",
    "ep": "expert-parallel mesh (FSDPEngine itself never reads it)",
}


_assertion = upstream_error("AssertionError")


def _normalize(config: Mapping[str, Any]) -> dict[str, int]:
    cfg: dict[str, int] = {}
    for key in _KEYS:
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{key} must be an integer, got {value!r}")
        cfg[key] = value
    return cfg


def _validate(world_size: int, cfg: Mapping[str, int]) -> None:
    """The checks in AReaL's order: ``ParallelStrategy.__post_init__``, then
    ``ParallelHelper.from_parallel_strategy`` and ``_validate``, then ``init_device_mesh``."""
    dp, sp, tp = (
        cfg["data_parallel_size"],
        cfg["context_parallel_size"],
        cfg["tensor_parallel_size"],
    )
    pp, ep, etp = (
        cfg["pipeline_parallel_size"],
        cfg["expert_parallel_size"],
        cfg["expert_tensor_parallel_size"],
    )
    strategy_world = dp * sp * tp * pp
    if ep > 1:
        emp = pp * etp * ep
        if emp == 0:
            raise LayoutError(
                "ParallelStrategy computes world_size % (pipeline x expert_tensor x expert "
                "parallel size) with a product of 0: integer modulo by zero",
                upstream="ZeroDivisionError",
            )
        if strategy_world % emp != 0:
            raise _assertion(
                f"Expert model parallel size {emp} cannot divide world size {strategy_world}."
            )
    if pp != 1:
        raise _assertion(
            f"Pipeline parallelism is not supported in FSDP (pipeline_parallel_size={pp})"
        )
    for key in (
        "context_parallel_size",
        "tensor_parallel_size",
        "expert_parallel_size",
        "expert_tensor_parallel_size",
    ):
        if cfg[key] < 1:
            raise _assertion(f"Parallelism degree should be >= 1 (got {key}={cfg[key]})")
    # ParallelHelper._validate's "dp * sp * tp != WORLD_SIZE" ValueError compares with the
    # strategy's own world_size, which is that product once pp == 1: it can never fire.
    if ep > 1:
        if etp not in (tp, 1):
            raise _assertion(
                f"Currently we only support ETP=TP or ETP=1 (expert_tensor_parallel_size={etp}, "
                f"tensor_parallel_size={tp})"
            )
        # ETP=TP: ep borrows all of sp and part of dp; ETP=1: all of sp x tp and part of dp.
        borrowed = sp if etp == tp else sp * tp
        pool = dp * borrowed
        if ep % borrowed != 0 or pool % ep != 0:
            what = "sp" if etp == tp else "sp x tp"
            raise _assertion(
                f"expert_parallel_size={ep} must be a multiple of {what} ({borrowed}) and divide "
                f"dp x {what} ({pool}) (ParallelHelper._validate, ETP="
                f"{'TP' if etp == tp else '1'})"
            )
    if dp < 1:
        # ParallelHelper never checks dp; torch 2.10's init_device_mesh fails on the shape.
        raise LayoutError(
            f"init_device_mesh gets mesh_shape ({dp}, {sp}, {tp}) from data_parallel_size={dp}; "
            "it must be >= 1",
            upstream="AssertionError" if dp == 0 else "RuntimeError",
        )
    if dp * sp * tp != world_size:
        raise _world_mismatch(world_size, dp, sp, tp)


def _world_mismatch(world_size: int, dp: int, sp: int, tp: int) -> LayoutError:
    """ParallelHelper never compares the strategy with the real world: init_device_mesh does."""
    size = dp * sp * tp
    hint = (
        f"set data_parallel_size={world_size // (sp * tp)}"
        if world_size % (sp * tp) == 0
        else f"context_parallel_size x tensor_parallel_size ({sp * tp}) must divide {world_size}"
    )
    if size > world_size:
        return LayoutError(
            f"data_parallel_size x context_parallel_size x tensor_parallel_size = {dp} x {sp} x "
            f"{tp} = {size} ranks, but the world has {world_size}: init_device_mesh refuses a "
            f"mesh bigger than the world; {hint}",
            upstream="RuntimeError",
        )
    return LayoutError(
        f"data_parallel_size x context_parallel_size x tensor_parallel_size = {dp} x {sp} x {tp} "
        f"= {size} ranks, but the world has {world_size}: init_device_mesh builds a mesh of ranks "
        f"0-{size - 1} only, and the ranks outside it fail with IndexError (list index out of "
        f"range) when build_mesh slices it for its first _flatten; {hint}",
        upstream="IndexError",
    )


def root_layout(world_size: int, cfg: Mapping[str, int]) -> Layout:
    """``build_mesh``'s root mesh, with every ``_flatten`` it makes registered."""
    dp, sp, tp = (
        cfg["data_parallel_size"],
        cfg["context_parallel_size"],
        cfg["tensor_parallel_size"],
    )
    ep, etp = cfg["expert_parallel_size"], cfg["expert_tensor_parallel_size"]
    if ep <= 1:
        root = Layout([("dp", dp), ("sp", sp), ("tp", tp)])
        root = root["dp", "sp"].flatten(name="dp_sp").root()
        return root["sp", "tp"].flatten(name="sp_tp").root()
    # etp == tp is tested first, so tp == 1 (where etp == 1 == tp) takes the ETP=TP branch;
    # both branches give the same mesh then.
    if etp == tp:
        dp_mod_ep, dp_in_ep, ep_dims = dp * sp // ep, ep // sp, ("dp_in_ep", "sp")
    else:
        dp_mod_ep, dp_in_ep = dp * sp * tp // ep, ep // (sp * tp)
        ep_dims = ("dp_in_ep", "sp", "tp")
    root = Layout([("dp_mod_ep", dp_mod_ep), ("dp_in_ep", dp_in_ep), ("sp", sp), ("tp", tp)])
    root = root["dp_mod_ep", "dp_in_ep"].flatten(name="dp").root()
    root = root["dp_mod_ep", "dp_in_ep", "sp"].flatten(name="dp_sp").root()
    root = root["sp", "tp"].flatten(name="sp_tp").root()
    return root[ep_dims].flatten(name="ep").root()


def expect(world_size: int, **config: Any) -> Expected:
    """Every group ``ParallelHelper.build_mesh`` hands out for ``config`` on ``world_size`` ranks.

    Example: ``expect(8, data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2)``
    has the (dp, sp, tp) = (2, 2, 2) mesh; ``groups("dp_sp")`` (FSDP) is ``[(0, 2, 4, 6),
    (1, 3, 5, 7)]`` and ``groups("sp_tp")`` is ``[(0, 1, 2, 3), (4, 5, 6, 7)]``.
    """
    reject_unknown("areal-fsdp", config, PARAMETERS)
    cfg = _normalize(config)
    _validate(world_size, cfg)
    root = root_layout(world_size, cfg)
    kinds: list[Kind] = [
        layout_kind(root, dim, f"root dim {dim!r}: {_PURPOSES[dim]}", dim)
        for dim in root.root_names
    ]
    # Every AReaL FSDP flatten is contiguous: slicing it back off the root is allowed.
    kinds += [
        layout_kind(root[alias], alias, f"_flatten of {' x '.join(axes)}: {_PURPOSES[alias]}")
        for alias, axes in root.aliases.items()
    ]
    roles = engine_roles(
        # fully_shard(mesh=dp_sp): gradients are reduce-scattered over data and Ulysses ranks.
        gradient_reduce="dp_sp",
        context="sp",
        expert_data="dp_mod_ep" if cfg["expert_parallel_size"] > 1 else None,
    )
    return Expected("areal-fsdp", world_size, cfg, kinds, roles, layout=root)


def engine_roles(
    *, gradient_reduce: str, context: str, expert_data: str | None, pipeline: str | None = None
) -> dict[str, str]:
    """The roles of an AReaL engine's mesh (this one's and Archon's): both compute the loss
    weight over data_parallel_group ('dp') and shard the model over 'tp'; the expert roles
    exist with EP only (``expert_data`` None without it)."""
    roles = {
        "data_parallel": "dp",
        "gradient_reduce": gradient_reduce,
        "loss": "dp",
        "tensor": "tp",
        "context": context,
    }
    if pipeline is not None:
        roles["pipeline"] = pipeline
    if expert_data is not None:
        roles |= {"expert": "ep", "expert_data": expert_data}
    return roles


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every (dp, sp, tp) split of the world, then each valid EP degree for both ETP modes.

    Only keys that differ from AReaL's default 1 are given. World 8 gives 36 configs.
    """
    for dp, sp, tp in ordered_factorizations(world_size, 3):
        base = above_one(data_parallel_size=dp, context_parallel_size=sp, tensor_parallel_size=tp)
        yield base
        modes = (1, tp) if tp > 1 else (1,)
        for etp in modes:
            pool = dp * sp if etp == tp else dp * sp * tp
            step = sp if etp == tp else sp * tp
            for ep in divisors(pool)[1:]:
                if ep % step == 0:
                    extra = {"expert_tensor_parallel_size": etp} if etp > 1 else {}
                    yield {**base, "expert_parallel_size": ep, **extra}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs ``ParallelHelper`` or the strategy refuse (``AssertionError``), and strategies
    whose product is not the world (torch's ``RuntimeError``)."""
    yield {"data_parallel_size": world_size // 2 or 1, "pipeline_parallel_size": 2}
    yield {"data_parallel_size": world_size, "context_parallel_size": 0}
    yield {"data_parallel_size": 2 * world_size}
    for dp, sp, tp in ordered_factorizations(world_size, 3):
        base = {
            "data_parallel_size": dp,
            "context_parallel_size": sp,
            "tensor_parallel_size": tp,
        }
        if tp > 2 and dp * sp > 1:
            # ETP neither 1 nor TP.
            yield {**base, "expert_parallel_size": dp * sp, "expert_tensor_parallel_size": 2}
        if sp > 1 and dp > 1 and tp == 1:
            # EP not a multiple of sp.
            odd = next((d for d in divisors(dp) if d > 1 and d % sp != 0), None)
            if odd is not None:
                yield {**base, "expert_parallel_size": odd}
    yield {"data_parallel_size": world_size, "expert_parallel_size": 3 * world_size}
