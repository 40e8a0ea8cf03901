"""The fake tier: one process, ranks in turn, metadata only, recorded and compared calls."""

from __future__ import annotations

import time

import pytest

from meshsim.errors import CollectiveDivergence, RankFailure, RankTimeout
from meshsim.harness import RankContext, context, run
from tests.harness._lines import line_of


def _mesh_body() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    flat = mesh["pp", "dp"]._flatten("pp_dp")
    return {
        "rank": dist.get_rank(),
        "ctx": context(),
        "coord": mesh.get_coordinate(),
        "dims": [dist.get_process_group_ranks(mesh.get_group(d)) for d in ("pp", "dp", "tp")],
        "flat": dist.get_process_group_ranks(flat.get_group()),
    }


def test_values_are_per_rank_and_groups_are_right() -> None:
    out = run(_mesh_body, 8, "fake")
    assert [o["rank"] for o in out] == list(range(8))
    assert out[5]["ctx"] == RankContext(rank=5, world_size=8, backend="fake", device="cpu")
    assert list(out[5]["coord"]) == [1, 0, 1]
    assert out[5]["dims"] == [[1, 5], [5, 7], [4, 5]]
    assert out[5]["flat"] == [1, 3, 5, 7]
    assert out.backend == "fake" and out.world_size == 8 and out.ranks == tuple(range(8))
    assert all(o.ok for o in out.outcomes)


def test_the_recording_is_returned() -> None:
    def body() -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dist.all_reduce(torch.ones(1), group=mesh.get_group("tp"))
        dist.barrier()

    out = run(body, 4, "fake")
    created = [(c.op, c.group, c.detail) for c in out.group_creations]
    assert created == [
        ("new_group", (0, 2), "desc='mesh_dp'"),
        ("new_group", (1, 3), "desc='mesh_dp'"),
        ("new_group", (0, 1), "desc='mesh_tp'"),
        ("new_group", (2, 3), "desc='mesh_tp'"),
    ]
    assert [c.describe() for c in out.calls[3]] == [
        "all_reduce on group (2,3)",
        "barrier on the world",
    ]


def test_a_call_is_recorded_the_same_however_its_arguments_are_passed() -> None:
    """The recorder binds arguments by position for speed: a group made by position and one
    made by keyword are described alike, and a collective's group argument by position is
    still read."""

    def body() -> list[str]:
        import torch
        import torch.distributed as dist

        made = [
            dist.new_group([0, 1], None, None, None, False, "by_position"),
            dist.new_group(ranks=[0, 1], group_desc="by_keyword"),
        ]
        dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, made[1])
        return [dist.get_process_group_ranks(g) for g in made]

    out = run(body, 2, "fake")
    assert out[0] == [[0, 1], [0, 1]]
    described = [(c.op, c.group, c.detail) for c in out.group_creations]
    assert described == [
        ("new_group", (0, 1), "desc='by_position'"),
        ("new_group", (0, 1), "desc='by_keyword'"),
    ]
    assert [c.describe() for c in out.calls[1]] == ["all_reduce on group (0,1)"]


def test_sampled_ranks_of_a_huge_world() -> None:
    def body() -> tuple:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (32, 64, 64), mesh_dim_names=("a", "b", "c"))
        ranks = dist.get_process_group_ranks(mesh.get_group("b"))
        coordinate = tuple(mesh.get_coordinate())  # a list on torch 2.10
        return dist.get_world_size(), coordinate, ranks[:2], len(ranks)

    out = run(body, 131_072, "fake", ranks=[131_071, 0, 4097])
    assert out.ranks == (131_071, 0, 4097)
    assert out[0] == (131_072, (31, 63, 63), [127_039, 127_103], 64)
    assert out[1] == (131_072, (0, 0, 0), [0, 64], 64)
    assert out[2] == (131_072, (1, 0, 1), [4097, 4161], 64)


def test_state_does_not_leak_from_one_rank_to_the_next() -> None:
    def body() -> tuple:
        import torch.distributed as dist
        from torch.distributed.device_mesh import _mesh_resources, init_device_mesh

        seen = (dist.get_pg_count(), len(_mesh_resources.mesh_stack))
        shape = (2, 4) if dist.get_rank() % 2 else (4, 2)  # each rank builds another mesh
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("x", "y"))
        mesh.__enter__()  # left entered on purpose: the harness must clear it
        return seen, dist.get_process_group_ranks(mesh.get_group("y"))

    with pytest.raises(CollectiveDivergence):  # odd and even ranks create different groups
        run(body, 8, "fake")
    out = run(body, 8, "fake", ranks=[1, 3])
    assert out[0] == ((1, 0), [0, 1, 2, 3])
    assert out[1] == ((1, 0), [0, 1, 2, 3])


def test_callers_own_process_group_is_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        sub = dist.new_group([0])
        out = run(lambda: dist.get_world_size(), 4, "fake")
        assert out == [4, 4, 4, 4]
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        t = torch.ones(1)
        dist.all_reduce(t, group=sub)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()


def test_failures_are_merged_with_compressed_ranks() -> None:
    def body() -> int:
        import torch.distributed as dist

        rank = dist.get_rank()
        assert rank in (0, 1, 2, 3, 6), f"rank {rank} is not allowed"
        return rank

    with pytest.raises(RankFailure) as info:
        run(body, 10, "fake")
    text = str(info.value)
    assert "ranks 4, 5: AssertionError: rank 4 is not allowed" not in text  # distinct messages
    assert "rank 4: AssertionError: rank 4 is not allowed" in text
    assert "5 of 10 ranks failed" in text
    failures = info.value.failures
    assert [o.rank for o in failures] == [4, 5, 7, 8, 9]
    assert failures[0].error_type == "AssertionError"
    assert "in body" in failures[0].traceback


def test_identical_failures_merge() -> None:
    def body() -> None:
        import torch.distributed as dist

        if dist.get_rank() != 4:
            raise ValueError("same everywhere")

    with pytest.raises(RankFailure, match=r"ranks 0-3, 5-7: ValueError: same everywhere"):
        run(body, 8, "fake")


def test_mismatched_collectives_raise_collective_divergence() -> None:
    def body() -> None:
        import torch
        import torch.distributed as dist

        group = dist.new_group([0, 1, 2, 3])
        t = torch.ones(1)
        for _ in range(4):
            dist.all_reduce(t)
        if dist.get_rank() == 2:
            dist.barrier()
        else:
            dist.all_reduce(t, group=group)

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 4, "fake")
    err = info.value
    text = str(err)
    # The user's line of each call, then its position (a step alone meant counting calls).
    at = line_of(body, "dist.all_reduce(t, group=group)")
    assert f"rank 0 called all_reduce on group (0,1,2,3) at {at} (step 5)" in text
    assert f"rank 2 called barrier on the world at {line_of(body, 'barrier()')} (step 5)" in text
    assert err.ranks == (0, 2) and err.group == (0, 1, 2, 3) and err.index == 0
    assert isinstance(err, RankFailure)


def test_mismatched_group_creation_raises() -> None:
    def body() -> None:
        import torch.distributed as dist

        dist.new_group([0, 1])
        dist.new_group([0, 2] if dist.get_rank() == 3 else [0, 1, 2])

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 4, "fake")
    assert info.value.kind == "creation" and info.value.index == 1
    at = line_of(body, "dist.new_group([0, 2]")
    assert f"rank 3 called new_group for group (0,2) at {at} (step 1)" in str(info.value)


def test_missing_collective_is_reported_with_what_the_rank_did() -> None:
    def body() -> None:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))
        if dist.get_rank() != 1:
            dist.all_gather_object([None] * dist.get_world_size(), dist.get_rank())

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 2, "fake")
    text = str(info.value)
    gather, reduce = line_of(body, "all_gather_object"), line_of(body, "all_reduce")
    assert f"rank 0 called all_gather_object on the world at {gather} (step 1)" in text
    assert f"rank 1 made no such call (it returned after its call at {reduce} (step 0))" in text


def test_different_groups_on_different_ranks_are_fine() -> None:
    """Pipeline-like: each half talks on its own group; ranks outside a group are not compared."""

    def body() -> list[int]:
        import torch
        import torch.distributed as dist

        first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
        mine = first if dist.get_rank() < 2 else second
        for _ in range(dist.get_rank() // 2 + 1):  # the halves do different amounts of work
            dist.all_reduce(torch.ones(1), group=mine)
        if dist.get_rank() == 0:
            dist.send(torch.ones(1), dst=2)  # point-to-point is not compared
        if dist.get_rank() == 2:
            dist.recv(torch.ones(1), src=0)
        return dist.get_process_group_ranks(mine)

    assert run(body, 4, "fake") == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_device_mesh_groups_are_recorded_and_compared() -> None:
    def body() -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        shape = (2, 4) if dist.get_rank() != 5 else (4, 2)
        init_device_mesh("cpu", shape)

    with pytest.raises(CollectiveDivergence) as info:
        run(body, 8, "fake", ranks=[0, 5])
    assert "desc='mesh_dim_0'" in str(info.value)


def test_functional_collectives_are_recorded() -> None:
    def body() -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        if dist.get_rank() == 0:
            funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))

    with pytest.raises(CollectiveDivergence, match=r"all_reduce \(functional\) on the world"):
        run(body, 2, "fake")


def test_a_hanging_rank_times_out_with_its_stack() -> None:
    def body() -> None:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            while True:
                time.sleep(0.01)

    with pytest.raises(RankTimeout) as info:
        run(body, 3, "fake", timeout=1)
    err = info.value
    assert err.collectives == {1: None}
    assert "time.sleep(0.01)" in err.stacks[1]
    assert "rank 0: returned" in str(err) and "1 later rank(s) were not run" in str(err)


def test_the_timeout_is_per_rank_not_for_the_whole_run() -> None:
    """Ranks stand for concurrent processes: three ranks each well inside the timeout pass,
    though together they take longer than it (one watchdog re-armed for each rank)."""

    def body() -> int:
        import torch.distributed as dist

        time.sleep(0.8)
        return dist.get_rank()

    assert run(body, 3, "fake", timeout=2) == [0, 1, 2]
