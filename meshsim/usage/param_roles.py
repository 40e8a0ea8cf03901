"""What reduction each parameter's gradient needs, read from the marks frameworks put on it.

A parameter's gradient must be reduced over the groups its *role* names, in the reference's
words (:class:`meshsim.Expected` kinds):

* ``dense``: the gradient group (``gradient_reduce``; Megatron ``dp-cp``).
* ``expert``: the expert data-parallel group (``expert_data``; Megatron ``expert:dp``), the
  ranks that hold the same experts. Megatron marks these ``param.allreduce = False``.
* ``sequence_parallel``: the gradient group and the tensor-parallel group (``tensor``): the
  weight is replicated over tp but each tp rank saw only its slice of the sequence, so its
  gradient is a partial sum. Megatron marks these ``param.sequence_parallel = True`` and
  all-reduces them over tp in ``finalize_model_grads``.
* ``embedding``: the gradient group and the embedding group (``embedding``), the first and
  last pipeline stages that tie the word embedding to the output head. Megatron marks the
  tied weight ``param.shared = True`` / ``param.shared_embedding = True``.

Marks combine (an expert weight under sequence parallelism needs ``expert_data`` and
``tensor``). An explicit ``roles={"glob-or-name": role}`` mapping wins over the marks: an exact
name first, then the first glob (``fnmatch``) that matches, in the mapping's order.

Parameter *names* are not read: ``experts.`` in a name is not a sound sign of an expert
parameter. Megatron's ``shared_experts`` are dense (reduced over the gradient group), and a
Hugging Face MoE without expert parallelism keeps every expert on every rank (dense as well).
Name them in ``roles=`` instead (``{"*.experts.*": "expert"}``), which says it on purpose.

Pure Python: the marks are read with ``getattr``, so a live ``torch.nn.Parameter`` and the
:class:`Marks` a rank sends back answer the same.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast, get_args

from meshsim.errors import RolesUnknown, UsageError
from meshsim.model.expected import Expected

ParamRole = Literal["dense", "expert", "sequence_parallel", "embedding"]

#: Every role a parameter can have, with the words a report uses for why it needs its groups.
PARAM_ROLES: Final[Mapping[str, str]] = {
    "dense": "dense: reduced over the gradient group",
    "expert": "expert: reduced over the ranks holding the same experts",
    "sequence_parallel": "sequence parallel: replicated over tp, each tp rank saw a slice",
    "embedding": "tied embedding: shared by the first and last pipeline stage",
}

#: A user's ``roles=`` mapping: parameter name or glob -> one role or several.
RolesArg = Mapping[str, str | tuple[str, ...]]


@dataclass(frozen=True)
class Marks:
    """The marks one parameter carries, under the attribute names Megatron gives them.

    A rank reads them off each live parameter (:meth:`of`) and sends them back; the check
    then reads them exactly as it would read the parameter.
    """

    allreduce: bool = True
    sequence_parallel: bool = False
    shared: bool = False
    shared_embedding: bool = False

    @classmethod
    def of(cls, param: Any) -> Marks:
        """The marks of ``param`` (any object; missing attributes take Megatron's defaults)."""
        return cls(
            allreduce=getattr(param, "allreduce", True) is not False,
            sequence_parallel=getattr(param, "sequence_parallel", False) is True,
            shared=getattr(param, "shared", False) is True,
            shared_embedding=getattr(param, "shared_embedding", False) is True,
        )


def validate_roles(roles: RolesArg | None) -> dict[str, tuple[ParamRole, ...]]:
    """``roles=`` normalised to name/glob -> tuple of roles; raise on an unknown role."""
    out: dict[str, tuple[ParamRole, ...]] = {}
    for pattern, value in (roles or {}).items():
        chosen = (value,) if isinstance(value, str) else tuple(value)
        wrong = [r for r in chosen if r not in get_args(ParamRole)]
        if wrong or not chosen:
            raise UsageError(
                f"roles[{pattern!r}] = {value!r}: each role is one of "
                f"{list(get_args(ParamRole))} (or a tuple of them), e.g. "
                "roles={'*.experts.*': 'expert', '*.norm.weight': 'sequence_parallel'}"
            )
        out[pattern] = cast("tuple[ParamRole, ...]", chosen)
    return out


def param_roles(name: str, param: Any, roles: RolesArg | None = None) -> tuple[ParamRole, ...]:
    """The roles of parameter ``name``: ``roles=`` if a key matches, else its marks.

    Example:
        A Megatron layernorm weight under sequence parallelism (``weight.sequence_parallel =
        True``) gives ``("sequence_parallel",)``; a plain weight ``("dense",)``.
    """
    chosen = validate_roles(roles)
    if name in chosen:
        return chosen[name]
    for pattern, value in chosen.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    marks = Marks.of(param)
    found: list[ParamRole] = []
    if not marks.allreduce:
        found.append("expert")
    if marks.sequence_parallel:
        found.append("sequence_parallel")
    if marks.shared or marks.shared_embedding:
        found.append("embedding")
    return tuple(found) or ("dense",)


def needed_kinds(
    name: str, param: Any, expected: Expected, roles: RolesArg | None = None
) -> tuple[str, ...]:
    """The reference's kinds ``name``'s gradient must be reduced over, in reduction order.

    A role the layout lacks (no tensor parallelism: no ``tensor`` role) needs nothing; a role
    the reference cannot tell raises :class:`~meshsim.errors.RolesUnknown`.

    Example:
        ``meshsim.expect("megatron", 8, tensor_model_parallel_size=2,
        expert_model_parallel_size=2)``: a ``sequence_parallel`` weight needs
        ``("dp-cp", "tp")``, an ``allreduce = False`` weight ``("expert:dp",)``.
    """
    wanted = param_roles(name, param, roles)
    meshsim_roles: list[str] = []
    if "expert" in wanted and _has_expert_data(name, expected):
        meshsim_roles.append("expert_data")
    else:  # no expert parallelism at all: every rank holds every expert, as a dense weight
        meshsim_roles.append("gradient_reduce")
    if "sequence_parallel" in wanted:
        meshsim_roles.append("tensor")
    if "embedding" in wanted:
        meshsim_roles.append("embedding")
    kinds: list[str] = []
    for role in meshsim_roles:
        if role in expected.unknown_roles:
            raise RolesUnknown(expected.unknown_roles[role])
        if role in expected.roles:
            kinds.append(expected.roles[role])
    return tuple(dict.fromkeys(kinds))


def _has_expert_data(name: str, expected: Expected) -> bool:
    if "expert_data" in expected.roles:
        return True
    if "expert_data" in expected.unknown_roles:
        raise RolesUnknown(expected.unknown_roles["expert_data"])
    if "expert" in expected.roles:
        raise RolesUnknown(
            f"{name!r} is an expert parameter, and {expected.framework}'s reference has an "
            "expert group but names no expert_data group (the ranks that reduce expert "
            "gradients together); pass roles={'expert_data': ...} to meshsim.expect"
        )
    return False


def describe_roles(wanted: tuple[str, ...]) -> str:
    """``sequence parallel: replicated over tp, ...``: why a parameter needs its groups."""
    return "; ".join(PARAM_ROLES[r] for r in wanted)
