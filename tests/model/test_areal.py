"""AReaL's ParallelGrid reference: hand-checked rank lists from realhf's topology.py rules."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import areal
from meshsim.model.invariants import find_violations


def _groups(world: int, kind: str, **config: Any) -> list[tuple[int, ...]]:
    return sorted(meshsim.expect("areal", world, **config).groups(kind).to_tuples())


def test_pipe_data_tensor_groups_by_hand() -> None:
    # rank = pipe * 4 + data * 2 + tensor (tensor fastest).
    exp = meshsim.expect("areal", 8, num_pp=2, num_dp=2, num_tp=2)
    assert exp.groups("pp_proc_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("dp_proc_group") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("slice_proc_group") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("ds_model_proc_group") == [(0, 1, 4, 5), (2, 3, 6, 7)]  # tp × pp
    assert exp.groups("tp_dp_proc_group") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # one per stage
    # Tied embedding groups even with tensor parallelism (DeepSpeed's grid refuses tp > 1).
    assert exp.groups("embedding_proc_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("position_embedding_proc_group") == [(0,), (1,), (2,), (3,)]
    assert exp.group_of(6, "embedding_proc_group") == (2, 6)
    assert exp.group_of(6, "position_embedding_proc_group") is None  # not the first stage
    assert exp.group_of(5, "p2p_groups") == (5, 1)  # wraps around to stage 0
    assert exp.group_of(1, "p2p_groups") == (1, 5)
    for twin in ("ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group"):
        assert exp.groups(f"{twin}_gloo") == exp.groups(twin)
        assert exp.kind(f"{twin}_gloo").backends == ("gloo",)
        assert exp.kind(twin).backends == ()
    assert list(exp.kinds()) == list(areal.KINDS)


def test_data_pipe_tensor_puts_data_outermost() -> None:
    # DataPipeTensorParallelTopology: rank = data * 4 + pipe * 2 + tensor.
    exp = meshsim.expect("areal", 8, num_pp=2, num_dp=2, num_tp=2, topology="data_pipe_tensor")
    assert exp.groups("pp_proc_group") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("dp_proc_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("slice_proc_group") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("ds_model_proc_group") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("tp_dp_proc_group") == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert exp.groups("position_embedding_proc_group") == [(0,), (1,), (4,), (5,)]
    assert exp.group_of(2, "p2p_groups") == (2, 0)
    assert exp.config["topology"] == "data_pipe_tensor"
    assert exp.layout is not None and exp.layout.dim_names == ("data", "pipe", "tensor")


def test_one_stage_embedding_groups_are_each_rank_alone() -> None:
    exp = meshsim.expect("areal", 4, num_dp=2, num_tp=2)
    assert exp.groups("embedding_proc_group") == [(0,), (1,), (2,), (3,)]
    assert exp.kind("embedding_proc_group").partition
    assert exp.group_of(3, "p2p_groups") == (3, 3)
    assert find_violations(exp) == []


def test_rank_mapping_places_the_grid_on_part_of_the_world() -> None:
    exp = meshsim.expect("areal", 16, num_pp=2, num_dp=2, num_tp=2, rank_mapping=range(8, 16))
    assert exp.groups("pp_proc_group") == [(8, 12), (9, 13), (10, 14), (11, 15)]
    assert exp.groups("ds_model_proc_group") == [(8, 9, 12, 13), (10, 11, 14, 15)]
    assert exp.group_of(13, "p2p_groups") == (13, 9)
    for kind in exp.kinds():
        assert exp.group_of(3, kind) is None  # outside the grid: no group of any kind
        assert not exp.kind(kind).partition
    assert exp.layout is not None and exp.layout.mesh.tolist() == [
        [[8, 9], [10, 11]],
        [[12, 13], [14, 15]],
    ]


def test_rank_mapping_on_even_ranks_as_dict_or_list() -> None:
    as_list = meshsim.expect("areal", 8, num_dp=2, num_tp=2, rank_mapping=[0, 2, 4, 6])
    as_dict = meshsim.expect("areal", 8, num_dp=2, num_tp=2, rank_mapping={3: 6, 0: 0, 2: 4, 1: 2})
    assert as_list.groups("slice_proc_group") == [(0, 2), (4, 6)]
    assert as_list.groups("dp_proc_group") == [(0, 4), (2, 6)]
    assert as_list.config == as_dict.config
    assert as_list.group_of(5, "dp_proc_group") is None


def test_default_mapping_is_the_first_ranks_and_num_dp_fills_the_mapping() -> None:
    first = meshsim.expect("areal", 8, num_dp=2, num_tp=2)
    assert first.groups("dp_proc_group") == [(0, 2), (1, 3)]
    assert first.group_of(4, "slice_proc_group") is None
    whole = meshsim.expect("areal", 8, num_tp=2)  # num_dp = 8 / 2
    assert whole.config["num_dp"] == 4
    mapped = meshsim.expect("areal", 8, num_tp=2, rank_mapping=[4, 5, 6, 7])  # num_dp = 4 / 2
    assert mapped.groups("dp_proc_group") == [(4, 6), (5, 7)]


@pytest.mark.parametrize(
    ("config", "upstream", "match"),
    [
        ({"num_dp": 8, "topology": "pipe_tensor_data"}, "KeyError", "namedtuple"),
        ({"num_dp": 8, "topology": ["pipe", "data", "model"]}, "KeyError", "namedtuple"),
        ({"num_dp": 2, "rank_mapping": {0: 5}}, "KeyError", "no world rank for grid rank 1"),
        ({"num_dp": 2, "rank_mapping": [3, 8]}, "ValueError", "Rank 8 is out of range"),
        ({"num_dp": 2, "rank_mapping": [3, 3]}, "ValueError", "duplicate"),
        ({"num_dp": 16}, "ValueError", "out of range"),
        ({"num_dp": 2, "rank_mapping": {0: 0, 1: 1, 2: 2}}, None, "does not have"),
        ({"num_tp": 3}, None, "give num_dp"),
        ({"num_tp": 0}, None, "num_tp must be an integer >= 1"),
        ({"num_pp": True}, None, "num_pp must be an integer"),
        ({"num_dp": 2, "rank_mapping": "01"}, None, "dict or a list"),
        ({"num_tps": 2}, None, "did you mean 'num_tp'"),
    ],
)
def test_refusals_name_the_upstream_exception(
    config: dict[str, Any], upstream: str | None, match: str
) -> None:
    with pytest.raises(LayoutError, match=match) as refused:
        meshsim.expect("areal", 8, **config)
    assert refused.value.upstream == upstream


def test_sweep_configs_and_refused_configs() -> None:
    cases = meshsim.layouts(8, "areal")
    assert len(cases) == 44 and len({c.id for c in cases}) == 44
    partial = [c for c in cases if len(c.expect().config["rank_mapping"]) < 8]
    assert len(partial) == 24
    assert all(areal.grid(8, **c.config).keeps_order for c in cases)
    unordered = list(areal.configs(8, unordered=True))
    assert len(unordered) == 54 and all(areal.expect(8, **c) for c in unordered)
    for config in areal.refused_configs(8):
        with pytest.raises(LayoutError) as refused:
            meshsim.expect("areal", 8, **config)
        assert refused.value.upstream in ("KeyError", "ValueError"), config
    assert len(meshsim.layouts(3, "areal")) == 6  # odd world: no half-world placements


def test_order_breaking_mapping_leaves_ranks_without_their_groups() -> None:
    # Grid ranks 1 and 2 swap world ranks. A process takes its index among the model's world
    # ranks (ascending) for its grid rank, so world rank 1 (grid 2) acts as grid 1 and is handed
    # grid 1's groups, which do not hold it: it has no data- or tensor-parallel group.
    config = {"num_dp": 2, "num_tp": 2, "rank_mapping": [0, 2, 1, 3]}
    exp = meshsim.expect("areal", 4, **config)
    assert exp.groups("dp_proc_group") == [(0, 1), (2, 3)]  # grid (0, 2), (1, 3), sorted
    assert [exp.group_of(r, "dp_proc_group") for r in range(4)] == [(0, 1), None, None, (2, 3)]
    assert [exp.group_of(r, "slice_proc_group") for r in range(4)] == [(0, 2), None, None, (1, 3)]
    assert exp.group_of(1, "tp_dp_proc_group") == (0, 1, 2, 3)  # one group: found either way
    assert exp.group_of(1, "p2p_groups") == (1, 1)  # the pair list does not use the rank
    assert not exp.kind("dp_proc_group").partition
    assert exp.kind("tp_dp_proc_group").partition
    lost = {(b.world_rank, b.kind) for b in areal.order_breaks(4, **config)}
    assert (1, "dp_proc_group") in lost and (2, "slice_proc_group_gloo") in lost
    assert not any(r in (0, 3) for r, _ in lost)
    assert areal.order_breaks(4, num_dp=2, num_tp=2, rank_mapping=[0, 1, 2, 3]) == []


def test_smallest_order_break_loses_data_parallel_groups() -> None:
    # Two stages on swapped ranks: each process takes the other's stage, so its data-parallel
    # group (itself alone, on the other rank) is not its own; no rank holds the first stage's
    # position-embedding group.
    exp = meshsim.expect("areal", 2, num_pp=2, rank_mapping=[1, 0])
    assert [exp.group_of(r, "dp_proc_group") for r in range(2)] == [None, None]
    assert [exp.group_of(r, "position_embedding_proc_group") for r in range(2)] == [None, None]
    assert exp.group_of(0, "pp_proc_group") == (0, 1)
    assert exp.local_rank(1, "pp_proc_group") == 1  # new_or_get_group sorts: stage 0 is second
    assert exp.groups("p2p_groups") == [(1, 0), (0, 1)]


def test_held_groups_survive_pickling_and_local_ranks() -> None:
    exp = meshsim.expect("areal", 4, num_dp=2, num_tp=2, rank_mapping=[0, 2, 1, 3])
    groups = exp.groups("dp_proc_group")
    again = pickle.loads(pickle.dumps(groups))
    assert [again.group_of(r) for r in range(4)] == [(0, 1), None, None, (2, 3)]
    assert groups.local_ranks(4).tolist() == [0, -1, -1, 1]
    assert groups.local_rank(1) is None


def test_several_models_on_one_world_share_groups_over_the_same_ranks() -> None:
    actor = {"num_pp": 2, "num_dp": 2, "num_tp": 2}
    critic = {"num_dp": 4, "rank_mapping": [4, 5, 6, 7]}
    models = areal.expect_models(8, [actor, critic])
    assert models[0].groups("tp_dp_proc_group") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert models[1].groups("dp_proc_group") == [(4, 5, 6, 7)]
    assert models[1].group_of(0, "dp_proc_group") is None
    shared = {(s.ranks, s.backend): s for s in areal.shared_groups(8, [actor, critic])}
    across = shared[((4, 5, 6, 7), "nccl")]
    assert across.models == (0, 1)
    assert set(across.users) == {
        (0, "tp_dp_proc_group"),
        (1, "process_group"),
        (1, "dp_proc_group"),
        (1, "tp_dp_proc_group"),
    }
    assert set(shared[((0, 4), "nccl")].users) == {
        (0, "pp_proc_group"),
        (0, "embedding_proc_group"),
    }
    assert ((0, 1, 2, 3), "nccl") not in shared  # actor's stage 0 only
    # On a gloo world a group and its gloo twin are one object.
    gloo = {(s.ranks, s.backend): s for s in areal.shared_groups(8, [actor], backend="gloo")}
    assert {(0, "dp_proc_group"), (0, "dp_proc_group_gloo")} <= set(gloo[((0, 2), "gloo")].users)


def test_identical_models_share_every_group() -> None:
    config = {"num_pp": 2, "num_dp": 2}
    shared = areal.shared_groups(4, [config, config])
    users = {u for s in shared for u in s.users}
    assert {(m, k) for m in (0, 1) for k in areal.KINDS if k != "p2p_groups"} <= users
    assert all(s.models == (0, 1) for s in shared)


def test_a_million_ranks_answer_from_arrays() -> None:
    exp = meshsim.expect("areal", 1 << 20, num_pp=8, num_tp=8)
    assert exp.group_of(123457, "dp_proc_group")[:3] == (1, 9, 17)
    assert exp.group_of(5, "embedding_proc_group") == (5, 917509)
    assert exp.group_of(5, "p2p_groups") == (5, 131077)
