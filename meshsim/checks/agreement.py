"""Several meshes on one world must agree where they overlap.

A job rarely holds one mesh. transformers builds a dense and an expert mesh and its Trainer
builds a third through accelerate; an RL job holds the policy's and the reference model's. Each
mesh can be right on its own and the job still wrong: the loader reads the data rank off one
mesh while the gradients are reduced over another (peers given different batches), one name
means two different groups, two meshes over the same ranks end up on one communicator (two
models' collectives interleave and hang) or compare equal (DTensor's sharding cache hands one
mesh's placements to the other). These checks compare every pair of meshes rank by rank.

The comparison works on plain views (:class:`MeshView`), so the reference
(:func:`expected_views`, every rank at once) and live ``DeviceMesh`` es (:func:`live_views`, this
rank) are judged by the same code.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import TYPE_CHECKING, Any

from meshsim.errors import MeshesDisagree, UsageError
from meshsim.harness.outcome import rank_label

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshsim.model.expected import Expected
    from meshsim.model.layout import Layout

#: Dim names that mean "a data-parallel replica" when ``data_dims`` is not given.
DATA_DIM_NAMES = frozenset(
    {"dp", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp", "data_parallel", "data"}
)
#: A mesh with one of these dims is an expert view: its ranks' data come from the dense mesh,
#: so it has no data rank of its own unless ``data_dims`` names one.
EXPERT_DIM_NAMES = frozenset({"ep", "efsdp", "edp", "ep_shard", "ep_replicate", "expert"})
#: Name of ``Expected.layout`` among the meshes of a reference.
MAIN = "main"


@dataclass(frozen=True)
class DimView:
    """One dim of a mesh as one rank holds it: its group, in mesh order, and its coordinate."""

    members: tuple[int, ...]
    local_rank: int
    #: Identity of the process group behind the dim (live meshes only).
    communicator: int | None = None


@dataclass(frozen=True)
class MeshView:
    """One rank's view of one named mesh: its root dims in order (None: rank not in the mesh)."""

    name: str
    dims: Mapping[str, DimView] | None
    #: Equal for two distinct live meshes that compare and hash equal (None: no such twin).
    identity: Hashable | None = None


@dataclass(frozen=True)
class Disagreement:
    """Two meshes disagree on one rank about one thing."""

    rank: int
    meshes: tuple[str, str]
    aspect: str
    detail: str
    #: What the finding is about, the same on every rank it holds for (``"main:dp_shard =
    #: expert:ep_shard"``), so a summary can name the ranks once.
    subject: str = ""

    def __str__(self) -> str:
        return self.on(f"rank {self.rank}")

    def on(self, ranks: str) -> str:
        """This finding as it holds on ``ranks`` (its detail is this rank's)."""
        a, b = self.meshes
        mine = f"rank {self.rank}"
        detail = self.detail if ranks == mine else f"on {mine}, {self.detail}"
        return f"{ranks}: meshes {a!r} and {b!r}, {self.aspect}: {detail}"


@dataclass(frozen=True)
class Rules:
    """What the caller says is meant; everything else that two meshes share must agree.

    ``data_dims``: mesh -> the dims whose row-major coordinate is the data rank (None or ``()``:
    the mesh has none). Meshes not named get :data:`DATA_DIM_NAMES` among their dims, or none
    when they have an expert dim. ``same_groups``: pairs ``("mesh:dim", "mesh:dim")`` that are
    one group under two names on purpose. ``independent``: the meshes serve different models
    that may communicate at the same time, so they must not share a communicator.
    """

    data_dims: Mapping[str, Sequence[str] | None] = field(default_factory=dict)
    same_groups: frozenset[frozenset[str]] = frozenset()
    independent: bool = False

    @classmethod
    def of(
        cls,
        data_dims: Mapping[str, Sequence[str] | str | None] | None = None,
        same_groups: Iterable[tuple[str, str]] = (),
        independent: bool = False,
    ) -> Rules:
        dims = {
            mesh: ((value,) if isinstance(value, str) else tuple(value or ()))
            for mesh, value in (data_dims or {}).items()
        }
        pairs = []
        for pair in same_groups:
            if len(pair) != 2 or not all(isinstance(p, str) and ":" in p for p in pair):
                raise UsageError(f"same_groups takes pairs of 'mesh:dim' names, got {pair!r}")
            pairs.append(frozenset(pair))
        return cls(dims, frozenset(pairs), bool(independent))

    def data_dims_of(self, view: MeshView) -> tuple[str, ...]:
        assert view.dims is not None
        if view.name in self.data_dims:
            wanted = tuple(self.data_dims[view.name] or ())
            unknown = [d for d in wanted if d not in view.dims]
            if unknown:
                raise UsageError(
                    f"data_dims names {unknown} for mesh {view.name!r}, which has dims "
                    f"{tuple(view.dims)}"
                )
            return wanted
        if EXPERT_DIM_NAMES & set(view.dims):
            return ()
        return tuple(d for d in view.dims if d in DATA_DIM_NAMES)


def compare(rank: int, views: Sequence[MeshView], rules: Rules | None = None) -> list[Disagreement]:
    """Every disagreement between each pair of ``views`` (one rank's meshes) on ``rank``."""
    rules = rules or Rules()
    found: list[Disagreement] = []
    held = [v for v in views if v.dims is not None]
    for i, a in enumerate(held):
        for b in held[i + 1 :]:
            found += _data_rank(rank, a, b, rules)
            found += _names(rank, a, b, rules)
            found += _communicators(rank, a, b, rules)
    return found


def _data_rank(rank: int, a: MeshView, b: MeshView, rules: Rules) -> list[Disagreement]:
    da, db = rules.data_dims_of(a), rules.data_dims_of(b)
    if not da or not db:
        return []
    ra, rb = _data_coordinate(a, da), _data_coordinate(b, db)
    if ra == rb:
        return []
    detail = (
        f"{a.name} {_dims(da)} gives data rank {ra[0]} of {ra[1]}, {b.name} {_dims(db)} "
        f"gives {rb[0]} of {rb[1]}: a loader reading one mesh and a wrapper reducing over "
        "the other feed this rank's peers different batches"
    )
    subject = f"{a.name} {_dims(da)} / {b.name} {_dims(db)}"
    return [Disagreement(rank, (a.name, b.name), "data rank", detail, subject)]


def _data_coordinate(view: MeshView, dims: Sequence[str]) -> tuple[int, int]:
    """(data rank, data size): the row-major coordinate over ``dims``, as a flatten gives it."""
    assert view.dims is not None
    index, size = 0, 1
    for dim in dims:
        held = view.dims[dim]
        index = index * len(held.members) + held.local_rank
        size *= len(held.members)
    return index, size


def _names(rank: int, a: MeshView, b: MeshView, rules: Rules) -> list[Disagreement]:
    """One name for two groups, or two names for one group, between the views of one job.

    Independent meshes (two models) may name their own groups as they like; what they must
    not do is share a communicator (:func:`_communicators`). Two names for one group count
    only where the coincidence does not hang on size-1 dims (:func:`_singleton_caused`).
    """
    assert a.dims is not None and b.dims is not None
    if rules.independent:
        return []
    found = []
    for name_a, dim_a in a.dims.items():
        for name_b, dim_b in b.dims.items():
            same_name = name_a == name_b
            same_group = set(dim_a.members) == set(dim_b.members)
            if same_name and not same_group:
                aspect = f"one name, two groups ({name_a!r})"
                detail = f"{a.name} holds {dim_a.members}, {b.name} holds {dim_b.members}"
                subject = name_a
            elif same_group and not same_name and len(dim_a.members) > 1:
                meant = frozenset({f"{a.name}:{name_a}", f"{b.name}:{name_b}"})
                if meant in rules.same_groups or _singleton_caused(a, name_a, b, name_b):
                    continue
                aspect = "two names, one group"
                detail = (
                    f"{a.name}:{name_a} and {b.name}:{name_b} both hold "
                    f"{dim_a.members}; if meant, declare it: same_groups="
                    f"[({a.name + ':' + name_a!r}, {b.name + ':' + name_b!r})] "
                    f"(meshsim meshes --same {a.name}:{name_a}={b.name}:{name_b})"
                )
                subject = f"{a.name}:{name_a} = {b.name}:{name_b}"
            else:
                continue
            found.append(Disagreement(rank, (a.name, b.name), aspect, detail, subject))
    return found


def _singleton_caused(a: MeshView, name_a: str, b: MeshView, name_b: str) -> bool:
    """Do ``a:name_a`` and ``b:name_b`` hold one group only because dims have size 1?

    A dim's group is equally the product of the dim with the size-1 dims beside it: in
    ``(dp_replicate, dp_shard, tp) = (2, 1, 4)``, ``dp_replicate`` holds the ranks of
    ``dp_replicate × dp_shard``, which an ``eval`` mesh calls ``dp``, and at another world size
    (``dp_shard`` 2) the two groups part. So a coincidence counts only when the two dims have
    the same size-1 neighbours, by name, on each side (the run of size-1 dims before the dim
    and after it, up to a dim of size > 1); otherwise it is singleton-caused and no finding.
    """
    return _size1_beside(a, name_a) != _size1_beside(b, name_b)


def _size1_beside(view: MeshView, name: str) -> tuple[frozenset[str], frozenset[str]]:
    """The size-1 dims next to ``name`` in ``view``'s dim order: (the run before, after)."""
    assert view.dims is not None
    sizes = [(dim, len(held.members)) for dim, held in view.dims.items()]
    at = [dim for dim, _ in sizes].index(name)

    def ones(side: Iterable[tuple[str, int]]) -> frozenset[str]:
        return frozenset(dim for dim, _ in takewhile(lambda pair: pair[1] == 1, side))

    return ones(reversed(sizes[:at])), ones(sizes[at + 1 :])


def _communicators(rank: int, a: MeshView, b: MeshView, rules: Rules) -> list[Disagreement]:
    assert a.dims is not None and b.dims is not None
    found = []
    if a.identity is not None and a.identity == b.identity:
        found.append(
            Disagreement(
                rank,
                (a.name, b.name),
                "equal meshes",
                detail="the two DeviceMeshes compare and hash equal (same ranks, layout, device "
                "and dim names), so DTensor's sharding-propagation cache serves one mesh's entries "
                "to the other; give them different dim names",
            )
        )
    if not rules.independent:
        return found
    for name_a, dim_a in a.dims.items():
        for name_b, dim_b in b.dims.items():
            if len(dim_a.members) < 2 or dim_a.communicator is None:
                continue
            if dim_a.communicator == dim_b.communicator:
                aspect = "shared communicator"
                detail = (
                    f"{a.name}:{name_a} and {b.name}:{name_b} are one process group "
                    f"over {dim_a.members}: two models' collectives on it interleave and hang "
                    "(torch hands a mesh dim spanning the whole world the default group, "
                    "named or not: any such dim since torch 2.10, a 1-D mesh's before; give "
                    "one model its own group with new_group)"
                )
            elif name_a == name_b and dim_a.members == dim_b.members:
                aspect = "equal sub-meshes"
                detail = (
                    f"{a.name}[{name_a!r}] and {b.name}[{name_b!r}] compare and hash "
                    f"equal as DeviceMeshes over {dim_a.members} on different process "
                    "groups, so DTensor's sharding-propagation cache hands one model's "
                    "entries (and group) to the other; name the dims apart"
                )
            else:
                continue
            subject = f"{a.name}:{name_a} = {b.name}:{name_b}"
            found.append(Disagreement(rank, (a.name, b.name), aspect, detail, subject))
    return found


def _dims(dims: Sequence[str]) -> str:
    return "(" + ", ".join(dims) + ")"


# -- views of the reference and of live meshes ------------------------------------------------


def expected_views(expected: Expected) -> dict[str, list[MeshView]]:
    """Every rank's view of every mesh the reference builds: ``main`` and ``Expected.meshes``."""
    layouts = {MAIN: expected.layout, **expected.meshes}
    return {
        name: layout_views(name, layout, expected.world_size)
        for name, layout in layouts.items()
        if layout is not None
    }


def layout_views(name: str, layout: Layout, world_size: int) -> list[MeshView]:
    """Each rank's view of the mesh ``layout`` describes (rank ``r`` at index ``r``)."""
    per_rank: list[dict[str, DimView]] = [{} for _ in range(world_size)]
    for dim in layout.root_names:
        for group in layout[dim].groups():
            members = tuple(int(r) for r in group)
            for position, member in enumerate(members):
                per_rank[member][dim] = DimView(members, position)
    return [MeshView(name, dims if dims else None) for dims in per_rank]


def live_views(meshes: Mapping[str, DeviceMesh]) -> list[MeshView]:
    """This rank's view of each live mesh (root dims only; nothing is created or flattened)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    objects = list(meshes.values())
    views = []
    for name, mesh in meshes.items():
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            views.append(MeshView(name, None))
            continue
        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        dims = {}
        for i, dim in enumerate(names):
            index: list[Any] = list(coordinate)
            index[i] = slice(None)
            members = tuple(int(r) for r in mesh.mesh[tuple(index)].tolist())
            assert members[coordinate[i]] == rank
            dims[dim] = DimView(members, coordinate[i], communicator=id(mesh.get_group(i)))
        views.append(MeshView(name, dims, identity=_equal_to(mesh, objects)))
    return views


def _equal_to(mesh: DeviceMesh, objects: Sequence[DeviceMesh]) -> int | None:
    """Where the first of ``mesh``'s twins stands in ``objects`` (``mesh`` itself included):
    twins are *other* objects that compare and hash equal, so every twin gets the same answer.
    None without one: one object passed under two names is the same mesh, not a collision."""
    twins = [
        i
        for i, other in enumerate(objects)
        if other is mesh or (other == mesh and hash(other) == hash(mesh))
    ]
    alone = all(objects[i] is mesh for i in twins)
    return None if alone else twins[0]


# -- the checks users call ---------------------------------------------------------------------


def check_meshes(
    meshes: Mapping[str, DeviceMesh] | Expected,
    *,
    data_dims: Mapping[str, Sequence[str] | str | None] | None = None,
    same_groups: Iterable[tuple[str, str]] = (),
    independent: bool = False,
    framework: str | None = None,
) -> list[Disagreement]:
    """Where several meshes of one job disagree: data rank, names, communicators.

    ``meshes`` is either this rank's live meshes by name (call it on every rank; nothing is
    communicated) or a reference :class:`~meshsim.Expected`, whose ``layout`` (named
    ``"main"``) and ``meshes`` are compared on every rank. See :class:`Rules` for the options;
    the groups ``framework``'s convention declares one on purpose are accepted too (a
    reference's own framework by default). Two names for one group are not reported when the
    coincidence hangs on size-1 dims: the two dims must have the same size-1 dims beside them,
    by name, on each side (``train:dp_replicate`` of ``(2, 1, 4)`` with ``dp_shard`` 1 and
    ``eval:dp`` of ``(2, 4)`` part at another world size, so they are no finding).

    Example, inside a rank: ``check_meshes({"model": model_mesh, "trainer": trainer_mesh})``
    is empty when both meshes give every rank the same data rank and name no group twice.
    """
    from meshsim.model.expected import Expected

    reference = meshes if isinstance(meshes, Expected) else None
    framework = framework or (reference.framework if reference is not None else None)
    declared = declared_same_groups(framework) if framework else ()
    rules = Rules.of(data_dims, [*same_groups, *declared], independent)
    if reference is not None:
        views = expected_views(reference)
        _known(views, rules)
        found: list[Disagreement] = []
        for rank in range(reference.world_size):
            found += compare(rank, [per_rank[rank] for per_rank in views.values()], rules)
        return found
    assert not isinstance(meshes, Expected)
    if len(meshes) < 2:
        raise UsageError(f"check_meshes compares two meshes or more, got {list(meshes)}")
    import torch.distributed as dist

    live = live_views(meshes)
    _known({v.name: [v] for v in live}, rules)
    return compare(dist.get_rank(), live, rules)


def declared_same_groups(framework: str) -> tuple[tuple[str, str], ...]:
    """Dims the convention declares one group on purpose (its ``SAME_GROUPS``), e.g.
    transformers' ``main:fsdp`` and its Trainer's ``trainer:dp_shard``."""
    from meshsim.model.conventions import CONVENTIONS, convention

    if framework not in CONVENTIONS:
        return ()
    return tuple(getattr(convention(framework), "SAME_GROUPS", ()))


def _known(views: Mapping[str, Any], rules: Rules) -> None:
    unknown = sorted(set(rules.data_dims) - set(views))
    for pair in rules.same_groups:
        unknown += sorted(p.split(":", 1)[0] for p in pair if p.split(":", 1)[0] not in views)
    if unknown:
        raise UsageError(f"no mesh named {sorted(set(unknown))}; the meshes are {list(views)}")


def assert_meshes_agree(
    meshes: Mapping[str, DeviceMesh] | Expected,
    *,
    data_dims: Mapping[str, Sequence[str] | str | None] | None = None,
    same_groups: Iterable[tuple[str, str]] = (),
    independent: bool = False,
    framework: str | None = None,
) -> None:
    """:func:`check_meshes`, raising :class:`~meshsim.errors.MeshesDisagree` on any finding.

    The message gives the first findings (both meshes, the ranks, what differs) and counts
    the rest; ``disagreements`` holds them all.
    """
    found = check_meshes(
        meshes,
        data_dims=data_dims,
        same_groups=same_groups,
        independent=independent,
        framework=framework,
    )
    if found:
        raise MeshesDisagree(summary(found), found)


def summary(found: Sequence[Disagreement], first: int = 3) -> str:
    """One line per finding, naming every rank it holds on; the first ``first``, then a count.

    A finding's detail is the first rank's (the groups it names are that rank's).
    """
    by_subject: dict[tuple[Any, ...], list[Disagreement]] = {}
    for d in found:
        by_subject.setdefault((d.meshes, d.aspect, d.subject or d.detail), []).append(d)
    lines = [
        same[0].on(rank_label([d.rank for d in same])) for same in list(by_subject.values())[:first]
    ]
    if len(by_subject) > first:
        lines.append(f"and {len(by_subject) - first} more finding(s)")
    return "\n".join(lines)
