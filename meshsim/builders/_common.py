"""Shared by the builders: name live meshes and groups by kind, prove them, one Observation."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshsim import torch_private
from meshsim.checks import GroupView, Observation, observe_groups
from meshsim.checks.snapshot import disagreements, mesh_backends
from meshsim.errors import LayoutError

# OLMo-core and legacy torchtitan slice flattened names from the root mesh, which torch 2.11+
# warns "will be deprecated"; the builders replay that on purpose, once per getter per rank.
warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh", UserWarning)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: What a builder hands :func:`collect` for one kind: a (sub-)mesh, a process group, a rank list
#: the framework hands out instead of a group (DeepSpeed's p2p pair), ``None`` (this rank holds
#: no group of that kind) or the exception the framework's getter raised.
Entry = Union[DeviceMesh, "ProcessGroup", tuple[int, ...], BaseException, None]


class FrameworkRejection(RuntimeError):
    """The framework's own config validation rejects the config, mirrored by a builder.

    ``upstream`` names the exception type the real framework raises (``"AssertionError"``,
    ``"OLMoConfigurationError"``, ...), so :func:`meshsim.verify.verify` can check that the
    reference rejects the same config the same way. A RuntimeError so that code catching
    torch's own mesh errors treats both alike.
    """

    def __init__(self, message: str, *, upstream: str | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream


@contextlib.contextmanager
def reference_rules() -> Iterator[None]:
    """Run a convention's config validation as the framework's own: its ``LayoutError`` becomes
    a :class:`FrameworkRejection` with the same ``upstream``.

    A config rule has one statement, the convention's; a builder that re-stated it would only
    check meshsim against itself. What stays independent is the groups: a builder gets sizes
    and names from the rules, never the reference's groups, and torch builds the meshes.
    """
    try:
        yield
    except LayoutError as error:
        raise FrameworkRejection(str(error), upstream=error.upstream) from error


def require(condition: bool, message: str, upstream: str | None = "AssertionError") -> None:
    """A framework's ``assert`` / ``raise`` on a bad config, kept alive under ``python -O``."""
    if not condition:
        raise FrameworkRejection(message, upstream=upstream)


def degree(config: Mapping[str, Any], key: str, default: int = 1) -> int:
    """An integer degree >= 1 from ``config`` (frameworks take plain ints, never bools)."""
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FrameworkRejection(f"{key} must be an integer >= 1, got {value!r}", upstream=None)
    return value


def mesh(shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """``init_device_mesh`` on this rank's device type (cpu, or cuda under nccl)."""
    device = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"
    return init_device_mesh(device, tuple(int(s) for s in shape), mesh_dim_names=tuple(names))


def flatten(root: DeviceMesh, dims: Sequence[str], name: str) -> DeviceMesh:
    """``root[dims]`` as one 1-D mesh: the dims' own mesh when there is one, else ``_flatten``.

    ``dims`` may come in any order; torch demands root order when slicing, so they are sorted
    by their position in the root (that order is the claim under test: Megatron and DeepSpeed
    list group members ascending, torch row-major over root order).
    """
    names = tuple(root.mesh_dim_names or ())
    ordered = tuple(sorted(dims, key=names.index))
    if len(ordered) == 1:
        return root[ordered[0]]
    return torch_private.flatten(root[ordered], name)


def all_groups(root: DeviceMesh, dims: Sequence[str]) -> list[list[int]]:
    """Every group spanning ``dims`` of ``root``, read off the root's full rank tensor.

    Collective group creation (``new_group``) needs every group on every rank, while a mesh
    only hands a rank its own; the root's ``mesh`` tensor holds all ranks, so torch's own
    tensor algebra (move the spanned dims last, reshape) lists them all.
    """
    names = list(root.mesh_dim_names or ())
    spanned = [names.index(d) for d in sorted(dims, key=names.index)]
    others = [i for i in range(len(names)) if i not in spanned]
    full = root.mesh  # torch recomputes it on every access: read once
    tensor = full.permute(*others, *spanned)
    size = 1
    for i in spanned:
        size *= int(full.shape[i])
    return [[int(r) for r in row] for row in tensor.reshape(-1, size).tolist()]


def new_groups(groups: Sequence[Sequence[int]], *, gloo: bool = False) -> ProcessGroup | None:
    """``new_group`` for every group, on every rank, in the same order; this rank's group.

    Returns None when this rank is in none of them (a middle stage and the embedding group).
    ``gloo=True`` is ``new_group(ranks, backend="gloo")``, Megatron's CPU twins; the fake
    backend (no gloo behind it) gets default-backend groups, metadata only anyway.
    """
    backend = "gloo" if gloo and str(dist.get_backend()) != "fake" else None
    me = dist.get_rank()
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks=list(ranks), backend=backend)
        if me in ranks:
            mine = group
    return mine


def collect(entries: Mapping[str, Entry]) -> Observation:
    """One Observation of every named entry, each proven by communication where it can be.

    1-D meshes and process groups go through :func:`meshsim.checks.observe_groups`; an n-D
    sub-mesh (OLMo's 2-D HSDP mesh) is one group whose members are the sub-mesh's ranks,
    row-major, proven by all-gathering along each of its dims in turn. Exceptions and None
    are recorded as absent: the diff then fails if the reference says the group exists.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    prove = backend != "fake"
    meshes = {n: e for n, e in entries.items() if isinstance(e, DeviceMesh) and e.ndim != 1}
    # The members of an n-D sub-mesh check each other's claims as process groups' do (inside
    # observe_groups): a group they disagree on is reported, not proven, as a collective over
    # it would never complete. Every rank makes both checks, so the store rounds pair up.
    # torch recomputes a mesh's rank tensor on every ``.mesh``: read each once.
    tensors = {n: m.mesh.tolist() for n, m in meshes.items()}
    claims = {n: tuple(flat_ranks(tensors[n])) for n in meshes}
    disagree = disagreements(claims) if prove else {}
    views = {
        n: _mesh_view(n, m, tensors[n], rank, prove, disagree.get(n)) for n, m in meshes.items()
    }
    others = {n: _group_of(e) for n, e in entries.items() if n not in meshes}
    views.update(observe_groups(others, prove=prove).groups)
    ordered = {name: views[name] for name in entries if name in views}  # the builder's order
    absent = tuple(name for name in entries if name not in views)
    return Observation(rank, world, backend, ordered, absent=absent)


def _group_of(entry: Entry) -> Any:
    """What :func:`observe_groups` takes for a builder's entry: a 1-D mesh's process group, a
    group or rank list as it is, None for an exception or no group (recorded absent)."""
    if entry is None or isinstance(entry, BaseException):
        return None
    return entry.get_group() if isinstance(entry, DeviceMesh) else entry


def flat_ranks(nested: Any) -> list[int]:
    """The ranks of a nested list (a mesh's ``tolist()``), in order."""
    if isinstance(nested, list):
        return [r for item in nested for r in flat_ranks(item)]
    return [int(nested)]


def _mesh_view(
    name: str,
    sub: DeviceMesh,
    tensor: list[Any],
    rank: int,
    prove: bool,
    disagreement: str | None,
) -> GroupView:
    members = tuple(flat_ranks(tensor))
    backends = mesh_backends(sub)
    prove = prove and disagreement is None and "fake" not in backends
    return GroupView(
        name=name,
        members=members,
        local_rank=members.index(rank) if rank in members else -1,
        mesh=tensor,
        gathered=_gather_along_dims(sub) if prove else None,
        disagreement=disagreement,
        backends=backends,
    )


def _gather_along_dims(sub: DeviceMesh) -> tuple[int, ...]:
    """All-gather this rank's id along the last dim, then that block along the next, ...

    The result is the whole sub-mesh in row-major order as the process groups see it.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device()) if sub.device_type == "cuda" else None
    )
    block = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    for dim in reversed(range(sub.ndim)):
        parts = [torch.empty_like(block) for _ in range(sub.size(dim))]
        dist.all_gather(parts, block, group=sub.get_group(dim))
        block = torch.cat(parts)
    return tuple(int(r) for r in block.tolist())
