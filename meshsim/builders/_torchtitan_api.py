"""Ask a built torchtitan ``ParallelDims`` every public getter, and observe the answers.

``entries(dims)`` works on torchtitan 0.3.0's own ``ParallelDims`` (the real adapter) and on the
plain-torch builder's replica alike: both expose ``world_mesh``, ``get_mesh``,
``get_optional_mesh``, ``spmd_meshes``, ``spmd_dense_mesh``, ``spmd_sparse_mesh``,
``get_dense_tp_mesh`` and the ``_single_axis_meshes`` / ``_global_meshes`` they slice from. The
names match the reference's kinds (``meshsim.model.conventions._torchtitan_api``); the
multi-axis requests are read off the live views, so a view the reference lacks shows up as a
name it does not know.

``observe(entries)`` records each answer: a mesh's members come from its rank tensor, and every
real (not ``fake``) process group under it is proven once by an all-gather of global ranks,
which must equal the tensor's line through this rank. torchtitan puts axes it counts as off on
the ``fake`` backend, which cannot communicate, so those are recorded unproven. Proving each
process group once (instead of once per getter) keeps ~230 getters per layout affordable.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshsim.builders._common import Entry, flat_ranks
from meshsim.checks import GroupView, Observation
from meshsim.checks.snapshot import disagreements, mesh_backends

# The kind names are the reference's (a name, not a group: the answers stay the live mesh's).
from meshsim.model.conventions._torchtitan_api import AXES, SINGLETONS, VIEW_DIMS

SPMD_AXES = ("dp_replicate", "dp", "dp_shard", "fsdp", "cp", "tp", "efsdp", "ep")


def _requests(dims: Any) -> list[tuple[str, ...]]:
    """In-order selections (>= 2) of each live view's valid dims, reversed views, two refused."""
    valid = set(dims._single_axis_meshes)
    wanted: dict[tuple[str, ...], None] = {}
    reverse: dict[tuple[str, ...], None] = {}
    for view in dims._global_meshes.values():
        names = [n for n in (view.mesh_dim_names or ()) if n in valid]
        for count in range(2, len(names) + 1):
            wanted.update(dict.fromkeys(combinations(names, count)))
        if len(names) > 1:
            reverse[tuple(reversed(names))] = None
    return [
        *wanted,
        *(r for r in reverse if r not in wanted),
        ("loss", "tp"),
        ("batch", "dp_replicate"),
    ]


def _name(method: str, request: str | tuple[str, ...], singletons: bool = False) -> str:
    shown = request if isinstance(request, str) else f"[{', '.join(request)}]"
    return f"{method}({shown}{', ' + SINGLETONS if singletons else ''})"


def entries(dims: Any) -> dict[str, Entry]:
    """Every getter's answer on this rank, by kind name: a mesh, None, or what it raised."""
    out: dict[str, Entry] = {}

    def ask(name: str, call: Callable[[], Any]) -> None:
        try:
            out[name] = call()
        except Exception as error:  # the framework's answer: compared as absent
            out[name] = error

    for axis in AXES:
        ask(axis, lambda a=axis: dims.get_mesh(a))
    ask("world_mesh", lambda: dims.world_mesh)
    for request in [*AXES, *_requests(dims)]:
        arg = request if isinstance(request, str) else list(request)
        if not isinstance(request, str):
            ask(_name("get_mesh", request), lambda a=arg: dims.get_mesh(a))
        ask(_name("get_optional_mesh", request), lambda a=arg: dims.get_optional_mesh(a))
        ask(
            _name("get_optional_mesh", request, True),
            lambda a=arg: dims.get_optional_mesh(a, include_singleton_axes=True),
        )
    for view, names in VIEW_DIMS.items():
        for dim in names:
            ask(f"{view}[{dim}]", lambda v=view, d=dim: dims._global_meshes[v][d])
    for index in (0, 1):
        label = f"spmd_meshes()[{index}]"
        ask(label, lambda i=index: dims.spmd_meshes()[i])
        for axis in SPMD_AXES:
            ask(f"{label}[{axis}]", lambda i=index, a=axis: dims.spmd_meshes()[i][a])
    ask("spmd_dense_mesh()", dims.spmd_dense_mesh)
    ask("spmd_sparse_mesh()", dims.spmd_sparse_mesh)
    ask("get_dense_tp_mesh()", dims.get_dense_tp_mesh)
    return out


def observe(named: dict[str, Entry]) -> Observation:
    """One Observation of every entry; each real process group proven once, in entry order
    (the same on every rank, so the all-gathers pair up)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    proofs: dict[str, tuple[int, ...]] = {}
    views: dict[str, GroupView] = {}
    meshes = {n: e for n, e in named.items() if isinstance(e, DeviceMesh)}
    absent = [n for n in named if n not in meshes]
    # Many getters hand out the same DeviceMesh, and torch recomputes ``.mesh`` (its rank
    # tensor) on every access: read each mesh's ranks and backends once.
    read: dict[int, tuple[list[Any], tuple[str, ...]]] = {}
    for entry in meshes.values():
        if id(entry) not in read:
            read[id(entry)] = (entry.mesh.tolist(), mesh_backends(entry))
    claims = {n: tuple(flat_ranks(read[id(m)][0])) for n, m in meshes.items()}
    disagree = disagreements(claims)  # claims compared first: inconsistent views never hang
    for name, entry in meshes.items():
        members = claims[name]
        agreed = name not in disagree
        gathered = _proof(entry, rank, members, proofs) if backend != "fake" and agreed else None
        views[name] = GroupView(
            name=name,
            members=members,
            local_rank=members.index(rank) if rank in members else -1,
            mesh=read[id(entry)][0],
            gathered=gathered,
            disagreement=disagree.get(name),
            backends=read[id(entry)][1],
        )
    return Observation(rank, world, backend, views, absent=tuple(absent))


def _proof(
    sub: DeviceMesh, rank: int, members: tuple[int, ...], proofs: dict[str, tuple[int, ...]]
) -> tuple[int, ...] | None:
    """``members`` when every real dim group's all-gather equals the rank tensor's line through
    this rank; the first disagreeing all-gather otherwise; None when no dim could be proven."""
    coordinate = sub.get_coordinate()
    if coordinate is None:
        return None
    proven = False
    for dim in range(sub.ndim):
        group = sub.get_group(dim)
        if str(dist.get_backend(group)) == "fake" or sub.size(dim) == 1:
            continue
        key = group.group_name
        if key not in proofs:
            proofs[key] = _all_gather_ranks(group, sub.size(dim))
        index = list(coordinate)
        index[dim] = slice(None)
        line = tuple(int(r) for r in sub.mesh[tuple(index)].tolist())
        if proofs[key] != line:
            return proofs[key]
        proven = True
    return members if proven else None


def _all_gather_ranks(group: Any, size: int) -> tuple[int, ...]:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else None
    )
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return tuple(int(t.item()) for t in out)
