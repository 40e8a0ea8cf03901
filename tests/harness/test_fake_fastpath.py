"""The fake tier's non-member fast path leaves every rank exactly where torch's own path does.

Each body below returns, per rank, everything torch's group bookkeeping holds: the groups
(ranks and ``group_name``) of every mesh dim, ``_world.group_count``, the registered group
names and ``_world.pg_group_ranks`` (including the mapping torch leaves under
``NON_GROUP_MEMBER``). The run's recorded creations and per-rank calls are compared too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from meshsim.errors import CollectiveDivergence
from meshsim.harness import fake_groups, run
from tests.harness._lines import line_of
from tests.releases import needs_mesh_layout, needs_unflatten


def _state() -> dict[str, Any]:
    """This rank's torch.distributed bookkeeping, as plain data."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world

    def key(pg: Any) -> Any:
        return pg if isinstance(pg, int) or pg is None else ("pg", world.pg_names[pg])

    return {
        "group_count": world.group_count,
        "names": list(world.pg_names.values()),
        "group_ranks": [(key(pg), dict(m)) for pg, m in world.pg_group_ranks.items()],
    }


def _groups(mesh: Any) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for dim in mesh.mesh_dim_names:
        pg = mesh.get_group(dim)
        out[dim] = (dist.get_process_group_ranks(pg), pg.group_name, pg.group_desc)
    return out


def _mesh_ops() -> dict[str, Any]:
    """init_device_mesh, user new_group before and after, sub-mesh, _flatten, _unflatten."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    before = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    flat = sub._flatten("dp_tp")
    after = dist.new_group([1, 2, 3])
    unflat = flat._unflatten(0, (2, 2, 2), ("a", "b", "c"))
    return {
        "mesh": _groups(mesh),
        "sub": _groups(sub),
        "flat": _groups(flat),
        "unflat": _groups(unflat),
        "user": [getattr(g, "group_name", g) for g in (before, after)],
        "coord": mesh.get_coordinate(),
        "state": _state(),
    }


def _custom_mesh() -> dict[str, Any]:
    """A DeviceMesh over a permuted rank tensor, and a 1-D mesh (torch's world-group shortcut)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    perm = torch.tensor([3, 7, 0, 4, 1, 5, 2, 6, 11, 15, 8, 12, 9, 13, 10, 14])
    mesh = DeviceMesh("cpu", perm.reshape(2, 4, 2), mesh_dim_names=("x", "y", "z"))
    line = DeviceMesh("cpu", torch.arange(16), mesh_dim_names=("all",))
    return {"mesh": _groups(mesh), "line": _groups(line), "state": _state()}


def _override_mesh() -> dict[str, Any]:
    """A backend override takes torch's own path; the counters must still line up."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (4, 4), mesh_dim_names=("dp", "tp"), backend_override={"tp": "fake"}
    )
    return {"mesh": _groups(mesh), "state": _state()}


BODIES = {"mesh_ops": _mesh_ops, "custom": _custom_mesh, "override": _override_mesh}


def _run_both(body: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(fake_groups, "ENABLED", enabled)
        out = run(body, 16, "fake")
        results.append(
            (
                list(out),
                [(c.op, c.group, c.detail, c.local) for c in out.group_creations],
                {r: [c.describe() for c in calls] for r, calls in out.calls.items()},
            )
        )
    return results[0], results[1]


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[needs_unflatten] if n == "mesh_ops" else []) for n in sorted(BODIES)],
)
def test_fast_path_matches_torch_on_every_rank(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, fast = _run_both(BODIES[name], monkeypatch)
    values_slow, values_fast = slow[0], fast[0]
    for rank in range(16):
        assert values_fast[rank] == values_slow[rank], f"rank {rank}"
    assert fast[1] == slow[1]
    assert fast[2] == slow[2]


@needs_mesh_layout
def test_fast_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: the plain mesh goes through the fast path (once per non-member span)."""
    spans: list[tuple[int, int]] = []
    original = fake_groups.NonMemberFastPath._skip_rows

    def spy(self: Any, plan: Any, start: int, stop: int) -> None:
        spans.append((start, stop))
        original(self, plan, start, stop)

    monkeypatch.setattr(fake_groups.NonMemberFastPath, "_skip_rows", spy)
    run(_mesh_ops, 16, "fake", ranks=[5])
    assert spans and any(stop > start for start, stop in spans)


def test_a_body_that_patches_new_group_sees_every_call() -> None:
    """A body wrapping DeviceMesh's ``new_group`` gets torch's path: one call per group."""

    def body() -> int:
        import torch.distributed.device_mesh as dm

        calls = []
        original = dm.new_group

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("ranks"))
            return original(*args, **kwargs)

        dm.new_group = counting
        try:
            dm.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        finally:
            dm.new_group = original
        return len(calls)

    assert run(body, 8, "fake") == [6] * 8


def test_divergent_meshes_are_still_caught() -> None:
    """Two ranks building different meshes diverge on the first differing (skipped) creation."""

    def body() -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        shape = (4, 4) if dist.get_rank() != 9 else (2, 8)
        init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 16, "fake")
    assert info.value.kind == "creation" and info.value.index == 0
    at = line_of(body, "init_device_mesh(")  # the user's line, also for the fast path's records
    text = str(info.value)
    assert f"rank 0 called new_group for group (0,4,8,12) (desc='mesh_dp') at {at} (step 0)" in text
    assert f"rank 9 called new_group for group (0,8) (desc='mesh_dp') at {at} (step 0)" in text


def test_a_divergence_inside_a_run_of_skipped_rows_is_found_at_its_row() -> None:
    """The skipped rows are compared in bulk: a difference in the middle of them is still
    named at its own row, not at the start of the run of rows."""

    def body() -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ranks = list(range(16))
        if dist.get_rank() == 9:
            ranks[14], ranks[15] = 15, 14  # dp rows 2 and 3 differ; rank 9 is in row 1
        DeviceMesh("cpu", torch.tensor(ranks).reshape(4, 4), mesh_dim_names=("dp", "tp"))

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 16, "fake")
    assert info.value.kind == "creation" and info.value.index == 2
    text = str(info.value)
    assert "rank 0 called new_group for group (2,6,10,14)" in text
    assert "rank 9 called new_group for group (2,6,10,15)" in text


def test_a_rank_that_alters_its_mesh_tensor_leaves_the_next_ranks_alone() -> None:
    """torch's layout answers are kept for the run and shared by every rank; a rank writing
    into the rank tensor torch handed it must not change what the next rank is handed."""

    def body() -> list[list[int]]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        seen = mesh.mesh.tolist()
        mesh.mesh.add_(100)
        mesh["tp"].mesh.add_(100)
        return seen

    assert run(body, 8, "fake") == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 8
