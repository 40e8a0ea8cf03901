"""The only reader of live torch state: turn a DeviceMesh or process groups into Observations."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

from meshsim import torch_private
from meshsim.checks.observation import GroupView, Observation
from meshsim.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError(
            "meshsim.observe needs an initialised default process group; run it inside "
            "meshsim.run(...) or a @pytest.mark.meshsim test"
        )
    return dist


def _can_communicate(dist: Any) -> bool:
    return str(dist.get_backend()) != "fake"


def _prove(dist: Any, group: ProcessGroup, size: int) -> tuple[int, ...]:
    """All-gather every member's global rank over ``group``: the group proves itself."""
    import torch

    backend = str(dist.get_backend(group))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return tuple(int(t.item()) for t in out)


def disagreements(claims: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Group name -> why its members disagree about it, from the members' own claims.

    Each rank publishes the members it claims for every group in the world's store, then reads
    the claims of the members of its own groups: store reads, not collectives, so ranks outside
    every group (a mesh smaller than the world) need not take part, and nothing waits on a group
    whose members disagree. A collective over such a group never completes (rank 0 waits in
    (0, 2), rank 2 in (2, 3)): it is reported instead of proven. Empty on the fake backend.
    """
    dist = _dist()
    if not _can_communicate(dist):
        return {}
    store = torch_private.default_store()
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    prefix = f"meshsim/claims/{_next_observation()}"
    mine = {name: list(members) for name, members in claims.items()}
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    everyone: dict[int, dict[str, tuple[int, ...]]] = {rank: dict(claims)}
    found: dict[str, str] = {}
    for name, members in claims.items():
        for peer in members:
            if 0 <= peer < world and peer not in everyone:
                said = json.loads(store.get(f"{prefix}/{peer}"))
                everyone[peer] = {n: tuple(m) for n, m in said.items()}
        problem = _first_disagreement(name, rank, tuple(members), everyone, world)
        if problem is not None:
            found[name] = problem
    return found


_outside_harness = threading.local()


def _next_observation() -> int:
    """This rank's count of group checks in this run: equal on ranks that check in step.

    Counted on the rank's recorder sink, which the harness makes afresh for every job (a warm
    gloo worker keeps its world between jobs, so a process-wide count would drift between
    ranks that checked different numbers of times before); a thread-local count outside it.
    """
    from meshsim.harness import recorder

    holder = recorder._current_sink() or _outside_harness
    count = getattr(holder, "meshsim_group_checks", 0) + 1
    holder.meshsim_group_checks = count  # type: ignore[union-attr]
    return count


def _first_disagreement(
    name: str,
    rank: int,
    members: tuple[int, ...],
    everyone: Mapping[int, Mapping[str, tuple[int, ...]]],
    world: int,
) -> str | None:
    for peer in members:
        if not 0 <= peer < world:
            return (
                f"rank {rank} says {name} is {_fmt(members)}, naming rank {peer} outside a "
                f"world of {world}"
            )
        said = everyone[peer].get(name)
        if said != members:
            theirs = _fmt(said) if said is not None else "it holds no such group"
            return (
                f"ranks {rank} and {peer} disagree on {name}: rank {rank} says {_fmt(members)}, "
                f"rank {peer} says {theirs}"
            )
    return None


def _fmt(members: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, members)) + ")"


def backend_of(group: ProcessGroup) -> str:
    """The group's backend as torch names it: ``gloo``, ``nccl``, ``fake``, ``cpu:gloo``, ..."""
    return str(_dist().get_backend(group))


def mesh_backends(mesh: DeviceMesh) -> tuple[str, ...]:
    """The backend of each dim's process group of ``mesh``, in dim order."""
    return tuple(backend_of(mesh.get_group(dim)) for dim in range(mesh.ndim))


def _view(
    dist: Any,
    name: str,
    group: ProcessGroup,
    mesh: Any,
    prove: bool,
    disagreement: str | None = None,
) -> GroupView:
    members = tuple(int(r) for r in dist.get_process_group_ranks(group))
    backend = backend_of(group)
    prove = prove and disagreement is None and backend != "fake"
    gathered = _prove(dist, group, len(members)) if prove else None
    return GroupView(
        name=name,
        members=members,
        local_rank=int(dist.get_rank(group)),
        mesh=None if mesh is None else mesh.tolist(),
        description=getattr(group, "group_desc", None),
        gathered=gathered,
        disagreement=disagreement,
        backends=(backend,),
    )


def observe(mesh: DeviceMesh, *, prove: bool = True, include_flattened: bool = True) -> Observation:
    """Record every dim of ``mesh`` and every flattened dim registered on its root, on this rank.

    With ``prove=True`` (the default) each group is also proven by an all-gather of global ranks
    over it; the fake backend cannot communicate, so there the proof is skipped.
    """
    dist = _dist()
    names = mesh.mesh_dim_names
    if names is None:
        raise UsageError(
            "meshsim.observe needs a mesh with mesh_dim_names: build it with "
            "init_device_mesh(..., mesh_dim_names=(...)) so groups can be matched by name"
        )
    prove = prove and _can_communicate(dist)
    rows = _rows_through_me(mesh)
    found: dict[str, tuple[Any, Any]] = {
        dim: (mesh.get_group(dim), rows[i] if rows else mesh[dim].mesh)
        for i, dim in enumerate(names)
    }
    if include_flattened:
        for flat_name, flat_mesh in torch_private.flatten_mapping(mesh).items():
            found.setdefault(flat_name, (flat_mesh.get_group(), flat_mesh.mesh))
    claims = {n: tuple(dist.get_process_group_ranks(g)) for n, (g, _) in found.items()}
    disagree = disagreements(claims) if prove else {}
    groups = {
        n: _view(dist, n, group, sub, prove, disagree.get(n)) for n, (group, sub) in found.items()
    }
    coordinate = mesh.get_coordinate()
    return Observation(
        rank=int(dist.get_rank()),
        world_size=int(dist.get_world_size()),
        backend=str(dist.get_backend()),
        groups=groups,
        mesh_dim_names=tuple(names),
        coordinate=None if coordinate is None else tuple(int(c) for c in coordinate),
    )


def _rows_through_me(mesh: DeviceMesh) -> list[Any] | None:
    """Per dim, the row of ``mesh``'s rank tensor through this rank: what ``mesh[dim].mesh``
    is, read from one ``mesh.mesh`` (torch recomputes that tensor on each access, and
    ``mesh[dim]`` builds a sub-mesh; at 1,024 fake ranks that was a third of ``observe``).
    ``None`` where this rank is not in ``mesh`` (then ``mesh[dim]`` answers)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    tensor = mesh.mesh
    rows = []
    for dim in range(tensor.dim()):
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coordinate))
        rows.append(tensor[index])
    return rows


def observe_groups(
    groups: Mapping[str, ProcessGroup | Sequence[int] | None], *, prove: bool = True
) -> Observation:
    """Record named process groups (Megatron's and DeepSpeed's getters hand these out).

    A ``None`` group means this rank belongs to no group of that name (a middle pipeline stage
    and the embedding group); it is recorded as absent, and checked as such. A sequence of ranks
    is a rank list the framework hands out instead of a process group (DeepSpeed's
    ``grid.p2p_groups`` pair ``[rank, next stage]``): recorded as this rank's group of that
    name, neither proven nor compared between ranks, since no collective runs over it and its
    members each hold a different list.
    """
    dist = _dist()
    prove = prove and _can_communicate(dist)
    held = {
        name: group
        for name, group in groups.items()
        if group is not None and not _is_rank_list(group) and dist.get_rank(group) >= 0
    }
    claims = {name: tuple(dist.get_process_group_ranks(g)) for name, g in held.items()}
    disagree = disagreements(claims) if prove else {}
    # Each agreed group is proven with a collective; every rank walks the names in the same
    # order, so those collectives cannot deadlock.
    views: dict[str, GroupView] = {}
    for name, group in groups.items():
        if name in held:
            views[name] = _view(dist, name, held[name], None, prove, disagree.get(name))
        elif _is_rank_list(group):
            views[name] = _rank_list_view(name, group)  # type: ignore[arg-type]
    return Observation(
        rank=int(dist.get_rank()),
        world_size=int(dist.get_world_size()),
        backend=str(dist.get_backend()),
        groups=views,
        absent=tuple(name for name in groups if name not in views),
    )


def _is_rank_list(entry: object) -> bool:
    """True for a plain list/tuple of ranks (not a process group, not a DeviceMesh)."""
    return isinstance(entry, (list, tuple)) and all(
        isinstance(r, Integral) and not isinstance(r, bool) for r in entry
    )


def _rank_list_view(name: str, ranks: Sequence[int]) -> GroupView:
    """A rank list this rank was handed, as a GroupView: never proven, no backend."""
    members = tuple(int(r) for r in ranks)
    me = int(_dist().get_rank())
    return GroupView(
        name=name, members=members, local_rank=members.index(me) if me in members else -1
    )
