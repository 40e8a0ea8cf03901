"""The only reader of live torch state: turn a DeviceMesh or process groups into Observations."""

from __future__ import annotations

from collections.abc import Mapping
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


def _view(dist: Any, name: str, group: ProcessGroup, mesh: Any, prove: bool) -> GroupView:
    members = tuple(int(r) for r in dist.get_process_group_ranks(group))
    gathered = _prove(dist, group, len(members)) if prove else None
    return GroupView(
        name=name,
        members=members,
        local_rank=int(dist.get_rank(group)),
        mesh=None if mesh is None else mesh.tolist(),
        description=getattr(group, "group_desc", None),
        gathered=gathered,
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
    groups: dict[str, GroupView] = {}
    for dim in names:
        groups[dim] = _view(dist, dim, mesh.get_group(dim), mesh[dim].mesh, prove)
    if include_flattened:
        for flat_name, flat_mesh in torch_private.flatten_mapping(mesh).items():
            if flat_name not in groups:
                groups[flat_name] = _view(
                    dist, flat_name, flat_mesh.get_group(), flat_mesh.mesh, prove
                )
    coordinate = mesh.get_coordinate()
    return Observation(
        rank=int(dist.get_rank()),
        world_size=int(dist.get_world_size()),
        backend=str(dist.get_backend()),
        groups=groups,
        mesh_dim_names=tuple(names),
        coordinate=None if coordinate is None else tuple(int(c) for c in coordinate),
    )


def observe_groups(groups: Mapping[str, ProcessGroup | None], *, prove: bool = True) -> Observation:
    """Record named process groups (Megatron's and DeepSpeed's getters hand these out).

    A ``None`` group means this rank belongs to no group of that name (a middle pipeline stage
    and the embedding group); it is recorded as absent, and checked as such.
    """
    dist = _dist()
    prove = prove and _can_communicate(dist)
    views: dict[str, GroupView] = {}
    absent: list[str] = []
    for name, group in groups.items():
        if group is None:
            absent.append(name)
            continue
        if dist.get_rank(group) < 0:  # a handle to a group this rank is not in
            absent.append(name)
            continue
        views[name] = _view(dist, name, group, None, prove)
    return Observation(
        rank=int(dist.get_rank()),
        world_size=int(dist.get_world_size()),
        backend=str(dist.get_backend()),
        groups=views,
        absent=tuple(absent),
    )
