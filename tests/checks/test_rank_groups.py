"""Reference groups compare equal to torch's rank lists and stay hashable tuples."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import meshsim
from meshsim.model.groups import Groups, RankGroup
from tests.fake_rank import as_fake_rank


def test_group_equals_list_both_ways_and_hashes_as_tuple() -> None:
    group = meshsim.Layout(dp=2, tp=2).group_of(1, "tp")
    assert isinstance(group, RankGroup) and isinstance(group, tuple)
    # Both directions on purpose: list.__eq__ defers to the group's reflected __eq__.
    assert group == [0, 1] and [0, 1] == group  # noqa: SIM300
    assert group == (0, 1) and (0, 1) == group  # noqa: SIM300
    assert group != [1, 0] and [1, 0] != group  # noqa: SIM300
    assert (group != [0, 1]) is False and ([0, 1] != group) is False  # noqa: SIM300
    assert group != [0, 1, 2] and group != "01" and group != 1
    assert hash(group) == hash((0, 1))
    assert {group: "tp"}[(0, 1)] == "tp" and (0, 1) in {group}
    assert len({group, (0, 1), RankGroup((0, 1))}) == 1
    assert repr(group) == "(0, 1)"
    assert group[:1] == (0,)
    with pytest.raises(TypeError):
        hash([0, 1])  # lists stay unhashable: no equal-but-unhashable surprise for a set


def test_group_pickles_as_itself_and_feeds_numpy() -> None:
    group = meshsim.expect("megatron", 8, tensor_model_parallel_size=2).group_of(3, "tp")
    back = pickle.loads(pickle.dumps(group))
    assert type(back) is RankGroup and back == [2, 3]
    array = np.asarray(group)
    assert array.dtype.kind == "i" and array.tolist() == [2, 3]


def test_groups_equality_and_containment_accept_lists() -> None:
    tp = meshsim.expect("megatron", 8, tensor_model_parallel_size=2).groups("tp")
    assert [2, 3] in tp and (2, 3) in tp and RankGroup((2, 3)) in tp
    assert [3, 2] not in tp and [2, 3, 4] not in tp and "x" not in tp
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]] and tp == [[6, 7], [4, 5], [2, 3], [0, 1]]
    assert all(isinstance(g, RankGroup) for g in tp) and tp[1] == [2, 3]
    assert tp.array.dtype == np.int64 and tp.array.shape == (4, 2)
    assert not tp.array.flags.writeable
    assert Groups(tp.to_tuples()) == tp and hash(Groups(tp.to_tuples())) == hash(tp)


def test_torch_rank_lists_equal_the_reference_groups() -> None:
    dist = pytest.importorskip("torch.distributed")
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    layout = meshsim.Layout(dp=2, tp=2)
    for rank in range(4):
        with as_fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for dim in ("dp", "tp"):
                ranks = dist.get_process_group_ranks(mesh.get_group(dim))
                assert isinstance(ranks, list)
                assert ranks == layout.group_of(rank, dim)
                assert layout.group_of(rank, dim) == ranks
