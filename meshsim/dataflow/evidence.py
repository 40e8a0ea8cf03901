"""What the ranks' own meshes say, so a wiring hint blames the loader or the wrapper only when
the groups they were handed are right.

A sampler or gradient wrapper follows the mesh it is given. With the mesh's dims in the wrong
order, a correct sampler splits batches wrongly and a correct wrapper reduces over the wrong
ranks; a hint naming them would send the user to fix code that is right. DeviceMesh names each
dim's process group ``mesh_<dim>`` (``group_desc``, flattened dims too). Each rank records the
groups it holds under such names, and a name the reference also has as a kind is compared with
it: when no group of that name matches, the mesh is wrong and the hint says so first.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshsim.errors import UsageError
from meshsim.model.expected import Expected

#: rank -> dim name -> every member list this rank holds under ``mesh_<dim>``.
MeshGroups = Mapping[int, Mapping[str, tuple[tuple[int, ...], ...]]]

_PREFIX = "mesh_"


def require_data_movement(what: str) -> None:
    """Refuse a data-flow assertion where it cannot see the other ranks' data.

    On the fake backend ``all_gather_object`` moves nothing (each rank would see its own record
    N times, "two records for rank 0", or a torch INTERNAL ASSERT).
    """
    import torch.distributed as dist

    if dist.is_initialized() and str(dist.get_backend()) == "fake":
        raise UsageError(
            f"{what} gathers every rank's data, and the fake backend moves no data: run the "
            "body on backend 'threaded' or 'gloo' (the fake tier checks groups, not data)"
        )


def held_mesh_groups() -> dict[str, tuple[tuple[int, ...], ...]]:
    """Inside a rank: dim name -> member lists of the mesh groups this rank holds (empty
    outside a run, or on a torch that does not name mesh groups)."""
    import torch.distributed as dist

    from meshsim import torch_private

    if not dist.is_initialized():
        return {}
    me = dist.get_rank()
    found: dict[str, list[tuple[int, ...]]] = {}
    for group in list(torch_private.world().pg_map):
        desc = str(getattr(group, "group_desc", "") or "")
        if not desc.startswith(_PREFIX):
            continue
        members = tuple(int(r) for r in dist.get_process_group_ranks(group))
        if me in members:
            found.setdefault(desc[len(_PREFIX) :], []).append(members)
    return {name: tuple(lists) for name, lists in found.items()}


def wrong_mesh(held: MeshGroups, expected: Expected) -> str | None:
    """Why the mesh itself is wrong (the first dim, on the lowest rank), or None.

    Only names the reference also has are compared; a name held with several member lists
    (two meshes with one dim name) is wrong only when none of them is the reference's.
    """
    kinds = expected.kinds()
    first: str | None = None
    wrong: list[str] = []
    for rank in sorted(held):
        for name, lists in held[rank].items():
            if name not in kinds or name in wrong:
                continue
            want = expected.group_of(rank, name)
            if want is not None and tuple(want) not in lists:
                wrong.append(name)
                first = first or (
                    f"its {name!r} dim holds {_fmt(lists[0])} on rank {rank} where the "
                    f"reference has {_fmt(tuple(want))}"
                )
    if first is None:
        return None
    also = f" (also wrong: {', '.join(repr(n) for n in wrong[1:])})" if len(wrong) > 1 else ""
    return (
        f"the mesh itself: {first}{also}. The loader and the wrapper follow the mesh they are "
        "given, so fix the mesh first (meshsim.observe + meshsim.assert_layout names every "
        "wrong dim)"
    )


def _fmt(members: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, members)) + ")"
