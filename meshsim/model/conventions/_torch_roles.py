"""The roles of a plain torch ``DeviceMesh``, read off its dim names and checked on its groups.

A ``DeviceMesh`` carries names, not intentions. ``("dp_replicate", "dp_shard", "tp")`` means
HSDP to anyone who knows the naming families torch users, OLMo-core, torchtitan, accelerate
and transformers share, so the torch convention reads ``data_parallel`` and ``gradient_reduce``
off the names, one mesh view (the root, then each unflattened view) at a time:

* every dim of size > 1 needs a known name (a size-1 dim changes no group). A view with a
  name outside :data:`FAMILY`, or with an expert dim (expert views re-split the data ranks),
  answers nothing.
* ``data_parallel`` is the product of the view's data dims; a view holding a data x context
  dim (``dp_cp``, ``dp_shard_cp``, ``loss``) cannot form it.
* ``gradient_reduce`` is the product of its data, data x context and context dims: FSDP and
  HSDP reduce over cp too (OLMo-core's ``get_dp_model_mesh``, torchtitan's ``loss`` mesh).
* Groups settle what names only suggest. With a context dim in another view, a data answer
  whose groups hold two ranks of one cp group (torchtitan's ``fsdp`` is dp_shard x cp) and a
  gradient answer whose groups do not hold every cp group are dropped; the answers left must
  agree, and the gradient groups must hold the data groups.

The role's kind is a dim or flattened dim with those groups where the mesh has one, else a
product kind named ``a×b`` (groups only: no process group of its own, so it is marked
``derived`` and no builder or ``verify`` expects to observe it). Where no answer is
left the role is unknown, with the reason: never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

import numpy as np

from meshsim.model.expected import Kind, layout_kind
from meshsim.model.groups import Groups
from meshsim.model.layout import Layout

DATA: Final = "data"
DATA_CONTEXT: Final = "data x context"
CONTEXT: Final = "context"
TENSOR: Final = "tensor"
PIPELINE: Final = "pipeline"
EXPERT: Final = "expert"

#: Dim name -> what the ranks along it are to each other. Sources: torch's ``replicate``
#: (default mesh ``("replicate",)``), OLMo-core's ``MeshDimName`` (``dp``, ``dp_replicate``,
#: ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``, flattened ``dp_cp``), torchtitan's views
#: (``batch``, ``loss``/``loss_mesh``, ``fsdp``, ``efsdp``; legacy ``dp_shard_cp``,
#: ``dp_shard_mod_ep``, ``dp_shard_in_ep``), Lightning's ``data_parallel``/``tensor_parallel``.
FAMILY: Final[Mapping[str, str]] = MappingProxyType(
    {
        **dict.fromkeys(("dp", "data", "data_parallel", "batch", "replicate", "ddp"), DATA),
        **dict.fromkeys(("dp_replicate", "dp_shard", "fsdp"), DATA),
        **dict.fromkeys(("dp_shard_mod_ep", "dp_shard_in_ep"), DATA),
        **dict.fromkeys(("dp_cp", "dp_shard_cp", "loss", "loss_mesh"), DATA_CONTEXT),
        **dict.fromkeys(("cp", "context_parallel"), CONTEXT),
        **dict.fromkeys(("tp", "tensor_parallel"), TENSOR),
        **dict.fromkeys(("pp", "pipeline_parallel"), PIPELINE),
        **dict.fromkeys(("ep", "etp", "efsdp", "ep_replicate", "ep_shard", "expert"), EXPERT),
    }
)
#: Families whose ranks reduce gradients together.
_GRADIENT: Final = (DATA, DATA_CONTEXT, CONTEXT)
#: The one-dim roles, each from the first of these names the mesh has.
AXIS_NAMES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "tensor": ("tp", "tensor_parallel"),
        "context": ("cp", "context_parallel"),
        "pipeline": ("pp", "pipeline_parallel"),
        "expert": ("ep",),
    }
)
#: The product kind's separator (``dp_replicate×dp_shard``), as :func:`describe_kind` writes it.
TIMES: Final = "×"


@dataclass(frozen=True)
class Answer:
    """What one view says a role is: the product of ``dims`` (size > 1) of ``view``;
    ``fallback`` names a size-1 dim of the family when ``dims`` is empty."""

    view: Layout
    dims: tuple[str, ...]
    fallback: str | None = None

    def groups(self) -> Groups:
        if self.dims:
            return self.view.groups(*self.dims)
        return Groups(self.view.ranks().reshape(-1, 1))

    def __str__(self) -> str:
        return TIMES.join(self.dims) if self.dims else "no dim"


@dataclass
class Inferred:
    """role -> kind for what the names settle, the product kinds made for them, and role ->
    why for what they do not."""

    roles: dict[str, str] = field(default_factory=dict)
    derived: dict[str, Kind] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)


def infer(views: Sequence[Layout], kinds: Mapping[str, Kind]) -> Inferred:
    """The roles ``views`` (root first) settle, by the rules of the module docstring."""
    out = Inferred()
    for role, names in AXIS_NAMES.items():
        found = next((n for n in names if n in kinds and kinds[n].available), None)
        if found is not None:
            out.roles[role] = found
    data, grad, strangers = _answers(views)
    context = _context_groups(kinds) if len(views) > 1 else None
    if context is not None:
        data = [a for a in data if _apart(a.groups(), context)]
        grad = [a for a in grad if _within(context, a.groups())]
    settled: dict[str, Answer] = {}
    for role, answers in (("data_parallel", data), ("gradient_reduce", grad)):
        if not answers:
            out.unknown[role] = _why_none(strangers, context is not None, role)
            continue
        clash = _disagreement(answers)
        if clash:
            out.unknown[role] = clash
            continue
        settled[role] = answers[0]
        kind = _kind_for(answers, kinds, out.derived)
        if kind is not None:
            out.roles[role] = kind
    if len(settled) == 2 and len(views) > 1:
        d, g = settled["data_parallel"], settled["gradient_reduce"]
        if not _within(d.groups(), g.groups()):
            why = f"the gradient dims ({g}) do not hold the data dims ({d})"
            for role in settled:
                out.roles.pop(role, None)
                out.unknown[role] = why
    return out


def _answers(views: Sequence[Layout]) -> tuple[list[Answer], list[Answer], list[str]]:
    """Each view's data and gradient answer, and the dim names no answer could use."""
    data: list[Answer] = []
    grad: list[Answer] = []
    strangers: list[str] = []
    for view in views:
        family = {d: FAMILY.get(d) for d in view.dim_names}
        big = [d for d in view.dim_names if view.size_of(d) > 1]
        odd = [d for d in big if family[d] is None or family[d] == EXPERT]
        if odd:
            strangers += [d for d in odd if d not in strangers]
            continue
        if not any(family[d] == DATA_CONTEXT for d in big):
            data.append(_answer(view, big, family, (DATA,)))
        grad.append(_answer(view, big, family, _GRADIENT))
    return data, grad, strangers


def _answer(
    view: Layout, big: list[str], family: Mapping[str, str | None], wanted: tuple[str, ...]
) -> Answer:
    dims = tuple(d for d in big if family[d] in wanted)
    fallback = next((d for d in view.dim_names if family[d] in wanted), None)
    return Answer(view, dims, fallback)


def _context_groups(kinds: Mapping[str, Kind]) -> Groups | None:
    """The context-parallel groups when some view has a context dim of size > 1."""
    for name in AXIS_NAMES["context"]:
        kind = kinds.get(name)
        if kind is not None and kind.available and kind.groups().group_size > 1:
            return kind.groups()
    return None


def _labels(groups: Groups, size: int) -> np.ndarray:
    """rank -> index of its group (-1: in none)."""
    label = np.full(size, -1, dtype=np.int64)
    label[groups.array] = np.arange(len(groups))[:, None]
    return label


def _apart(a: Groups, b: Groups) -> bool:
    """No two ranks share a group of ``a`` and a group of ``b``."""
    size = int(max(a.array.max(initial=0), b.array.max(initial=0))) + 1
    label = _labels(a, size)[b.array]
    label = np.where(label < 0, -1 - b.array, label)  # a rank in no group of a: its own label
    label.sort(axis=1)
    return bool((label[:, 1:] != label[:, :-1]).all())


def _within(inner: Groups, outer: Groups) -> bool:
    """Every group of ``inner`` lies inside one group of ``outer``."""
    size = int(max(inner.array.max(initial=0), outer.array.max(initial=0))) + 1
    label = _labels(outer, size)[inner.array]
    return bool((label >= 0).all() and (label == label[:, :1]).all())


def _disagreement(answers: list[Answer]) -> str | None:
    if len(answers) < 2:  # one view: no groups computed (a huge world pays only when asked)
        return None
    first = answers[0].groups()
    for other in answers[1:]:
        if other.groups() != first:
            return f"two views disagree ({answers[0]} vs {other})"
    return None


def _why_none(strangers: list[str], has_context: bool, role: str) -> str:
    if not strangers and has_context:
        if role == "data_parallel":
            return "no view keeps the data dims apart from the context dim"
        return "no view's data and context dims hold the context groups"
    odd = [d for d in strangers if FAMILY.get(d) is None]
    expert = [d for d in strangers if FAMILY.get(d) == EXPERT]
    parts = []
    if odd:
        names = ", ".join(map(repr, odd))
        parts.append(f"{names} {'fits' if len(odd) == 1 else 'fit'} no naming family")
    if expert:
        names = ", ".join(map(repr, expert))
        parts.append(
            f"{names} {'is an expert dim' if len(expert) == 1 else 'are expert dims'}"
            ", which re-split the data ranks"
        )
    return "; ".join(parts) or "no view of the mesh answers"


def _kind_for(
    answers: list[Answer], kinds: Mapping[str, Kind], derived: dict[str, Kind]
) -> str | None:
    """The kind the agreeing ``answers`` name: a dim, then a flattened dim of any of their
    views, else a product kind over the first; None when every group is a single rank and no
    dim of the family stands for it."""
    first = answers[0]
    if not first.dims:
        return first.fallback
    for answer in answers:
        if len(answer.dims) == 1:
            return answer.dims[0]
    for answer in answers:
        view = answer.view
        for alias, axes in view.aliases.items():
            if tuple(a for a in axes if view.size_of(a) > 1) == answer.dims:
                return alias
    return product_kind(first.view, first.dims, kinds, derived)


def product_kind(
    view: Layout, dims: Sequence[str], kinds: Mapping[str, Kind], derived: dict[str, Kind]
) -> str:
    """The name of a kind over the product of ``dims`` of ``view``, made (into ``derived``)
    when neither ``kinds`` nor ``derived`` has it yet."""
    name = TIMES.join(dims)
    if name not in kinds and name not in derived:
        description = f"product of mesh dims {tuple(dims)}: groups only, no process group"
        derived[name] = layout_kind(view, name, description, *dims, derived=True)
    return name
