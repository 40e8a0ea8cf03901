"""Expected: every group a framework builds for one config, by kind and by role."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, final

import numpy as np

from meshsim.errors import LayoutError
from meshsim.model.groups import FAMILIES, Group, Groups
from meshsim.model.layout import Layout

Role = Literal[
    "data_parallel",
    "gradient_reduce",
    "tensor",
    "context",
    "pipeline",
    "expert",
    "expert_data",
    "embedding",
    "loss",
]

#: meshsim's cross-framework names for what a group is *for*.
ROLES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "data_parallel": "ranks that load different batches (the data loader's DP group; no CP)",
        "gradient_reduce": (
            "ranks whose gradients are reduced or sharded together (DP with CP folded in)"
        ),
        "tensor": "tensor-parallel peers: shard each layer's weights",
        "context": "context/sequence-parallel peers: shard the sequence",
        "pipeline": "pipeline stages of one model replica, in stage order",
        "expert": "expert-parallel peers: hold different experts",
        "expert_data": "ranks holding the same experts: reduce expert gradients together",
        "embedding": "ranks that tie the input embedding and the output head (first/last stage)",
        "loss": "ranks over which the loss and token counts are all-reduced",
    }
)

GroupSource = Groups | Callable[[], Groups] | LayoutError


@final
@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of group a framework creates, named as its users name it.

    ``source`` is the groups, a zero-argument function that computes them when first asked
    (so a million-rank world pays only for the kinds it queries), or the :class:`LayoutError`
    the framework raises when asked for this kind under this config.
    ``partition`` says whether the kind's groups cover every rank exactly once (embedding
    groups and p2p pairs do not). ``keyed_by_first`` says each rank's own group is the one it
    leads (DeepSpeed's ``[rank, next stage]`` pairs, where every rank also sits second in the
    previous stage's pair). ``mesh_dims``/``mesh_shape`` describe a multi-dim sub-mesh
    whose flattened ranks make each group (OLMo-core's 2-D HSDP mesh, for instance).
    ``backends`` names the backend each dim's process group must have, in ``mesh_dims`` order
    (one entry for a 1-D group); ``None`` or an empty tuple means the world's own backend.
    Frameworks pick others on purpose: megatron's gloo twins, torchtitan's ``fake`` size-1
    axes, ``init_device_mesh(backend_override=...)``; a real axis left ``fake`` never
    communicates, which no member list shows.
    ``derived`` marks a kind the reference makes up rather than one the framework builds: the
    product of mesh dims a role spans where the program never flattened them (torch's
    ``dp_replicate×dp_shard``). Its groups serve the role's checks (data flow, invariants),
    but no process group has them, so no builder, ``verify`` or ``sweep`` can observe it.
    """

    name: str
    description: str
    source: GroupSource
    partition: bool = True
    keyed_by_first: bool = False
    mesh_dims: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    backends: tuple[str | None, ...] = ()
    derived: bool = False
    _cache: list[Groups] = field(default_factory=list, repr=False)

    @property
    def available(self) -> bool:
        return not isinstance(self.source, LayoutError)

    def group_of(self, rank: int) -> Group | None:
        """``rank``'s group of this kind: the first holding it, or the one it leads."""
        groups = self.groups()
        if not self.keyed_by_first:
            return groups.group_of(rank)
        rows = np.flatnonzero(groups.array[:, 0] == rank) if len(groups) else ()
        return groups[int(rows[0])] if len(rows) else None

    def backends_on(self, world_backend: str, dims: int) -> tuple[str, ...]:
        """The backend each of ``dims`` process groups must report in a world on
        ``world_backend`` (``dist.get_backend(group)``'s spelling)."""
        named = self.backends if len(self.backends) == dims else (None,) * dims
        return tuple(world_backend if b is None else b for b in named)

    def groups(self) -> Groups:
        cache = self._cache  # first: every check asks every kind, often
        if cache:
            return cache[0]
        if isinstance(self.source, LayoutError):
            raise self.source.with_traceback(None)  # kinds may share it: keep no old frames
        groups = self.source if isinstance(self.source, Groups) else self.source()
        cache.append(FAMILIES.share(groups))
        return cache[0]

    def renamed(self, name: str, description: str) -> Kind:
        """This kind under another name: the same groups, worked out once for both
        (torchtitan's getters hand out a few views under ~230 names). Every field is spelled
        out: ``dataclasses.replace`` made a world-1,024 torchtitan sweep's layouts ~10% slower."""
        return Kind(
            name,
            description,
            self.source,
            partition=self.partition,
            keyed_by_first=self.keyed_by_first,
            mesh_dims=self.mesh_dims,
            mesh_shape=self.mesh_shape,
            backends=self.backends,
            derived=self.derived,
            _cache=self._cache,
        )


def layout_kind(
    layout: Layout,
    name: str,
    description: str,
    *dims: str,
    partition: bool = True,
    backends: tuple[str | None, ...] = (),
    derived: bool = False,
) -> Kind:
    """A kind whose groups span ``dims`` of ``layout`` (computed on first use); ``derived``:
    see :class:`Kind`."""
    spanned = dims or layout.dim_names
    shape = tuple(layout.size_of(d) for d in spanned)
    return Kind(
        name,
        description,
        lambda: layout.groups(*spanned),
        partition=partition,
        mesh_dims=tuple(spanned),
        mesh_shape=shape,
        backends=backends,
        derived=derived,
    )


@final
class Expected:
    """Every group one framework config creates: the reference a live mesh is checked against.

    ``groups`` takes a kind (``"dp-cp"``, ``"get_dp_model_mesh"``, ``"data"``) or a role
    (``"gradient_reduce"``); a kind wins when a name is both.

    Example:
        ```python
        exp = meshsim.expect("megatron", world_size=16, tensor_model_parallel_size=2,
                             pipeline_model_parallel_size=4)
        exp.groups("dp")[0] == (0, 2)
        exp.kind_of("tensor") == "tp"
        ```
    """

    __slots__ = (
        "_available", "_kinds", "_primary", "_roles", "_unknown_roles", "config", "framework",
        "layout", "meshes", "world_size",
    )  # fmt: skip

    def __init__(
        self,
        framework: str,
        world_size: int,
        config: Mapping[str, Any],
        kinds: Iterable[Kind],
        roles: Mapping[str, str],
        layout: Layout | None = None,
        meshes: Mapping[str, Layout] | None = None,
        primary: Iterable[str] | None = None,
        unknown_roles: Mapping[str, str] | None = None,
    ) -> None:
        self.framework = framework
        self.world_size = world_size
        self.config: Mapping[str, Any] = MappingProxyType(dict(config))
        self.layout = layout
        #: Further meshes the framework builds beside ``layout``, by name (OLMo-core's separate
        #: expert mesh is ``meshes["expert"]``), so their dim names and shape can be checked.
        self.meshes: Mapping[str, Layout] = MappingProxyType(dict(meshes or {}))
        self._kinds = {k.name: k for k in kinds}
        self._available: dict[str, str] | None = None
        not_roles = set(roles) - set(ROLES)
        if not_roles:
            raise ValueError(f"unknown roles {sorted(not_roles)}; roles are {list(ROLES)}")
        missing = {r: k for r, k in roles.items() if k not in self._kinds}
        if missing:
            raise ValueError(f"roles map to unknown kinds: {missing}")
        self._roles = MappingProxyType(dict(roles))
        unknown = dict(unknown_roles or {})
        if set(unknown) - set(ROLES) or set(unknown) & set(roles):
            raise ValueError(f"unknown_roles {sorted(unknown)} must be roles the mapping lacks")
        #: Roles the convention cannot tell under this config, each with the one-line reason
        #: (naming the ``roles=`` that settles it): checks that need one refuse, not guess.
        self._unknown_roles = MappingProxyType(unknown)
        #: The kinds users name first (torchtitan's axes, not its ~230 getter calls); None: all.
        self._primary = None if primary is None else tuple(primary)

    # -- kinds ----------------------------------------------------------------------------
    def kinds(self) -> dict[str, str]:
        """Available kinds, each with a one-line description, in the framework's order."""
        if self._available is None:  # every check asks; torchtitan has ~230 kinds
            self._available = {n: k.description for n, k in self._kinds.items() if k.available}
        return dict(self._available)

    def primary_kinds(self) -> list[str]:
        """The kinds a summary shows first, available or not, in the framework's order: every
        kind, except where a framework hands out far more (torchtitan: the world mesh, its
        axes and the kinds that serve a role; not each getter call and view dim)."""
        if self._primary is None:
            return list(self._kinds)
        wanted = set(self._primary) | set(self._roles.values())
        return [name for name in self._kinds if name in wanted]

    def derived_kinds(self) -> dict[str, str]:
        """Kinds the reference derives for a role (a product of mesh dims no process group
        spans), each with its description: listed by :meth:`kinds` and usable by name, but no
        program builds them, so builders and ``verify`` neither expect nor observe them."""
        return {n: k.description for n, k in self._kinds.items() if k.derived}

    def unavailable(self) -> dict[str, LayoutError]:
        """Kinds whose getter raises under this config, with the error the framework gives."""
        return {n: k.source for n, k in self._kinds.items() if isinstance(k.source, LayoutError)}

    def kind(self, name: str) -> Kind:
        """The :class:`Kind` behind a kind or role name."""
        if name in self._kinds:
            return self._kinds[name]
        if name in self._roles:
            return self._kinds[self._roles[name]]
        if name in self._unknown_roles:
            raise LayoutError(self._unknown_roles[name])
        raise LayoutError(
            f"{self.framework} has no group kind or role {name!r}; kinds: "
            f"{list(self._kinds)}; roles: {list(self._roles)}"
        )

    @property
    def roles(self) -> Mapping[str, str]:
        """meshsim role -> this framework's kind."""
        return self._roles

    @property
    def unknown_roles(self) -> Mapping[str, str]:
        """Roles this config may have but the convention cannot tell, each with why and the
        ``roles=`` that settles it (a plain torch mesh whose dim names fit no family). A role
        in neither ``roles`` nor here is one the layout does not have."""
        return self._unknown_roles

    def kind_of(self, role: str) -> str:
        if role in self._unknown_roles:
            raise LayoutError(self._unknown_roles[role])
        if role not in self._roles:
            raise LayoutError(
                f"{self.framework} has no group for role {role!r} under this config; "
                f"roles present: {list(self._roles)}"
            )
        return self._roles[role]

    # -- groups ---------------------------------------------------------------------------
    def groups(self, kind: str) -> Groups:
        return self.kind(kind).groups()

    def group_of(self, rank: int, kind: str) -> Group | None:
        """The group of ``kind`` holding ``rank`` (None when the rank is in none, e.g. a middle
        pipeline stage and the embedding group)."""
        self._check_rank(rank)
        return self.kind(kind).group_of(rank)

    def local_rank(self, rank: int, kind: str) -> int | None:
        self._check_rank(rank)
        group = self.kind(kind).group_of(rank)
        return None if group is None else group.index(rank)

    def pipeline_neighbors(self, rank: int) -> tuple[int, int]:
        """(previous, next) stage of ``rank`` in its pipeline group, wrapping around."""
        group = self.group_of(rank, "pipeline")
        assert group is not None  # the pipeline role partitions the world
        at = group.index(rank)
        return group[at - 1], group[(at + 1) % len(group)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world size {self.world_size}")

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"Expected({self.framework!r}, world_size={self.world_size}, {cfg})"
