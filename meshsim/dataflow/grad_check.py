"""``assert_gradient_sync``: prove after a real step that gradients were reduced over exactly the
gradient group and that replicas still hold bit-identical parameters.

Each rank fingerprints every parameter and gradient, full and unsharded (``full_tensor()`` for
FSDP2 / DTensor parameters), and the fingerprints are all-gathered over the world. The check
then reads the reference, not the program's groups: inside each ``gradient_reduce`` group all
fingerprints must agree. Scale each rank's loss by :func:`loss_scale` before ``backward`` so
that every rank contributes a different gradient: a member missing from the reduction then
changes the result on part of the group, even when every rank loaded the same data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from meshsim.dataflow import roles
from meshsim.dataflow.evidence import (
    MeshGroups,
    held_mesh_groups,
    require_data_movement,
    wrong_mesh,
)
from meshsim.errors import DataflowMismatch, NothingCompared, UsageError
from meshsim.model.expected import Expected


def loss_scale(rank: int | None = None) -> float:
    """This rank's loss multiplier for the probe step: distinct per rank, exact in floating point.

    ``loss = loss * meshsim.dataflow.loss_scale()`` before ``backward``; the reduced gradient is
    then a rank-weighted sum that only the right set of members reproduces on every member.
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    return float(rank + 1)


@dataclass(frozen=True)
class ParamPrint:
    """One parameter on one rank: name, full shape, fingerprints of value and gradient."""

    name: str
    shape: tuple[int, ...]
    value: str
    grad: str | None


def fingerprints(model: Any) -> list[ParamPrint]:
    """Every parameter of ``model`` (a module or wrapper), unsharded, as fingerprints.

    Collective for DTensor parameters (``full_tensor``): call on every rank in the same order.
    """
    if not hasattr(model, "named_parameters"):
        raise UsageError(
            f"assert_gradient_sync takes the model (a torch.nn.Module or wrapper), got "
            f"{type(model).__name__}"
        )
    prints = []
    for name, param in model.named_parameters():
        value = _full(param.detach())
        grad = None if param.grad is None else _full(param.grad)
        prints.append(
            ParamPrint(
                name, tuple(value.shape), _digest(value), None if grad is None else _digest(grad)
            )
        )
    return prints


def assert_gradient_sync(model: Any, expected: Expected) -> None:
    """Raise :class:`~meshsim.errors.DataflowMismatch` unless ``model`` is in sync by the roles.

    Call on every rank (collective) after ``backward`` and ``optimizer.step()``, with each
    rank's loss scaled by :func:`loss_scale`. Works for plain modules, torch
    ``DistributedDataParallel``, FSDP2 ``fully_shard`` (FSDP or HSDP meshes) and DTensor
    tensor-parallel layers. A reference that cannot tell the gradient groups raises
    :class:`~meshsim.errors.RolesUnknown` (pass ``roles=``); gradient groups of one rank each
    raise :class:`~meshsim.errors.NothingCompared`: neither is a pass.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("assert_gradient_sync runs inside a rank (meshsim.run or a meshsim test)")
    if dist.get_world_size() != expected.world_size:
        raise UsageError(
            f"the run has {dist.get_world_size()} ranks, the reference {expected.world_size}"
        )
    require_data_movement("assert_gradient_sync")
    mine = (fingerprints(model), held_mesh_groups())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    prints = {rank: theirs for rank, (theirs, _) in enumerate(gathered)}
    mesh_groups = {rank: held for rank, (_, held) in enumerate(gathered)}
    problems = find_problems(prints, expected, mesh_groups=mesh_groups)
    if problems:
        raise DataflowMismatch(problems, what="the parameters and gradients after the step")


def find_problems(
    by_rank: dict[int, list[ParamPrint]],
    expected: Expected,
    *,
    mesh_groups: MeshGroups | None = None,
) -> list[str]:
    """Every gradient group whose members disagree, one line each, naming the likely mistake
    (the mesh itself, when ``mesh_groups`` show a dim the reference has with other ranks).

    Raises :class:`~meshsim.errors.RolesUnknown` when the reference cannot tell the gradient
    groups, :class:`~meshsim.errors.NothingCompared` when every one is a single rank."""
    groups = roles.gradient_groups(expected)
    if all(len(group) < 2 for group in groups):
        raise NothingCompared(_nothing_compared(expected))
    if not any(p.grad is not None for prints in by_rank.values() for p in prints):
        return ["no parameter has a gradient on any rank: call after loss.backward()"]
    problems: list[str] = []
    mesh = wrong_mesh(mesh_groups or {}, expected)
    for group in groups:
        problems += _group_problems(group, by_rank, expected, mesh)
    return problems


def _nothing_compared(expected: Expected) -> str:
    kind = expected.roles.get("gradient_reduce")
    where = (
        f"every gradient_reduce group ({kind}) is a single rank"
        if kind
        else "the reference has no gradient_reduce group (no data or context parallelism)"
    )
    return (
        f"assert_gradient_sync compared nothing: {where}, so no two ranks must end the step "
        "with the same gradients; nothing was checked, which is not a pass"
    )


def _group_problems(
    group: tuple[int, ...],
    by_rank: dict[int, list[ParamPrint]],
    expected: Expected,
    mesh: str | None,
) -> list[str]:
    first = group[0]
    names = [p.name for p in by_rank[first]]
    for other in group[1:]:
        theirs = [p.name for p in by_rank[other]]
        if theirs != names:
            return [
                f"ranks {first} and {other} share gradient group ({roles.ranks_list(group)}) but "
                f"hold different parameters ({names[:3]} vs {theirs[:3]}): they are not "
                "replicas of one model shard"
            ]
    for index, name in enumerate(names):
        for field, noun in (("grad", "gradients"), ("value", "parameters")):
            classes: dict[Any, list[int]] = {}
            for rank in group:
                classes.setdefault(getattr(by_rank[rank][index], field), []).append(rank)
            if len(classes) > 1:
                split = list(classes.values())
                return [_split_message(name, noun, group, split, expected, mesh)]
    return []


def _split_message(
    name: str,
    noun: str,
    group: tuple[int, ...],
    classes: list[list[int]],
    expected: Expected,
    mesh: str | None,
) -> str:
    a, b = classes[0][0], classes[1][0]
    peers = _peers(expected, a, b)
    agree = "; ".join(f"ranks {roles.ranks_list(c)} agree" for c in classes if len(c) > 1)
    head = (
        f"parameter {name!r}: {peers} {a} and {b} share gradient group "
        f"({roles.ranks_list(group)}) but ended with different {noun}"
        + (f" ({agree})" if agree else "")
    )
    return head + ". Likely mistake: " + (mesh or _why(noun, group, classes, expected, peers))


def _peers(expected: Expected, a: int, b: int) -> str:
    if "data_parallel" in expected.roles:
        dp = expected.group_of(a, "data_parallel")
        if dp is not None and b in dp:
            return "data-parallel ranks"
    return roles.relation(expected, a, b)


def _why(
    noun: str, group: tuple[int, ...], classes: list[list[int]], expected: Expected, peers: str
) -> str:
    if noun == "parameters":
        return (
            "the gradients agree but the parameters do not: the replicas started from different "
            "values (different init seeds, or no broadcast of the initial weights)"
        )
    if all(len(c) == 1 for c in classes):
        return (
            "the gradients were not reduced at all (no data-parallel wrapper, or no_sync left on)"
        )
    observed = sorted(tuple(sorted(c)) for c in classes)
    wanted = roles.describe_kind(expected, expected.roles["gradient_reduce"])
    for kind, groups in roles.partitions(expected):
        inside = sorted(tuple(sorted(set(g) & set(group))) for g in groups if set(g) & set(group))
        if inside == observed:
            what = "the data-parallel group " if kind == expected.roles.get("data_parallel") else ""
            return (
                f"the wrapper reduces gradients over {what}{roles.describe_kind(expected, kind)} "
                f"instead of the gradient group {wanted}, so {peers} drift apart"
            )
    return (
        f"the wrapper reduces gradients over a subset of the gradient group {wanted}, split as "
        + " | ".join(roles.ranks_list(c) for c in observed)
    )


def _full(tensor: Any) -> Any:
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().contiguous()


def _digest(tensor: Any) -> str:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.view(-1).view(_bytes_dtype()).numpy().tobytes())
    return digest.hexdigest()


def _bytes_dtype() -> Any:
    import torch

    return torch.uint8
