"""Megatron-LM convention: RankGenerator, initialize_model_parallel's groups, checks, sweeps."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshsim
from meshsim import Groups, Layout, LayoutError
from meshsim.model.conventions import megatron
from meshsim.model.conventions._megatron_ranks import hierarchical_groups, hybrid_sizes
from meshsim.model.conventions.megatron import (
    PipelineRanks,
    RankGenerator,
    generate_masked_orthogonal_rank_groups,
    pipeline_ranks,
)
from meshsim.model.sweep import divisors, ordered_factorizations

DENSE = ("dp", "dp-cp", "cp", "tp", "pp", "tp-pp", "tp-dp", "tp-dp-cp", "tp-cp")
EXPERT = ("expert:ep", "expert:tp", "expert:tp-ep", "expert:tp-ep-pp", "expert:dp")
AXES = ("tp", "cp", "ep", "dp", "pp")
SIZE_KEYS = (
    "tensor_model_parallel_size",
    "context_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def expect(world: int, **config: object) -> meshsim.Expected:
    return meshsim.expect("megatron", world, **config)


def reference_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron's algorithm spelled out with loops: decompose the group index over the unmasked
    axes and the in-group index over the masked axes, first axis fastest, and add the strides."""
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]

    def digits(index: int, shape: list[int]) -> list[int]:
        out = []
        for size in shape:
            out.append(index % size)
            index //= size
        return out

    masked = [i for i, m in enumerate(mask) if m]
    unmasked = [i for i, m in enumerate(mask) if not m]
    group_size = math.prod(sizes[i] for i in masked)
    groups = []
    for g in range(math.prod(sizes) // group_size):
        base = sum(
            d * strides[i] for d, i in zip(digits(g, [sizes[i] for i in unmasked]), unmasked)
        )
        groups.append(
            [
                base
                + sum(d * strides[i] for d, i in zip(digits(r, [sizes[i] for i in masked]), masked))
                for r in range(group_size)
            ]
        )
    return groups


@st.composite
def split_world(draw: st.DrawFn, max_world: int = 64) -> tuple[int, dict[str, Any]]:
    """A world size split into tp × cp × pp (× dp), an expert split ep × etp, and an order."""
    world = draw(st.integers(1, max_world))
    tp = draw(st.sampled_from(divisors(world)))
    cp = draw(st.sampled_from(divisors(world // tp)))
    pp = draw(st.sampled_from(divisors(world // tp // cp)))
    ep = draw(st.sampled_from(divisors(world // pp)))
    etp = draw(st.sampled_from(divisors(world // pp // ep)))
    order = "-".join(draw(st.permutations(AXES)))
    return world, {
        "tensor_model_parallel_size": tp,
        "context_parallel_size": cp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "order": order,
    }


# -- generate_masked_orthogonal_rank_groups / RankGenerator ---------------------------------


def test_masked_groups_docstring_example() -> None:
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert groups.shape == (8, 3)
    assert groups[0].tolist() == [0, 2, 4]
    assert groups[1].tolist() == [1, 3, 5]
    assert groups[7].tolist() == [19, 21, 23]
    # The same through the order-string constructor the model is built on.
    assert Layout.from_order("tp-dp-pp", tp=2, dp=3, pp=4).groups("dp")[7] == (19, 21, 23)


def test_masked_groups_tp_pp_dp_docstring_example() -> None:
    # "if the gpu size is 8 and order is 'tp-pp-dp', size is '2-2-2', the dp_group here is
    # [[0, 4], [1, 5], [2, 6], [3, 7]]"
    groups = generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [False, False, True])
    assert groups.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    data=st.data(),
)
def test_masked_groups_match_the_loop_algorithm_exactly(
    sizes: list[int], data: st.DataObject
) -> None:
    mask = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    got = generate_masked_orthogonal_rank_groups(math.prod(sizes), sizes, mask)
    # Same groups, same group order, same order inside groups.
    assert got.tolist() == reference_groups(sizes, mask)


def test_masked_groups_reject_inconsistent_arguments() -> None:
    with pytest.raises(LayoutError, match="covers 8 ranks, not world_size 16"):
        generate_masked_orthogonal_rank_groups(16, [2, 2, 2], [True, False, False])
    with pytest.raises(LayoutError, match=r"mask .* has 2 entries"):
        generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, False])


def test_rank_generator_docstring_example_and_token_order() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=4, cp=1, order="tp-dp-pp")
    dp = gen.get_ranks("dp")
    assert (dp[0], dp[1], dp[7]) == ((0, 2, 4), (1, 3, 5), (19, 21, 23))
    assert gen.order == "tp-dp-pp-ep-cp"  # missing size-1 axes appended, slowest
    assert gen.world_size == 24
    assert gen.get_ranks("tp-dp") == gen.get_ranks("dp-tp")
    assert gen.get_ranks("dp-tp").array.tolist() == gen.get_ranks("tp-dp").array.tolist()


def test_rank_generator_rank_offset() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=8)
    assert gen.get_ranks("dp") == Groups([(8, 10), (9, 11)])


def test_rank_generator_lowercases_order() -> None:
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="TP-DP-PP")
    assert gen.get_ranks("pp") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])


def test_rank_generator_errors() -> None:
    with pytest.raises(LayoutError, match="EP or CP, not both") as info:
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert info.value.upstream == "AssertionError"
    with pytest.raises(LayoutError, match="leaves out 'cp', whose size is 2") as info:
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-dp-pp")
    assert info.value.upstream == "RuntimeError"
    with pytest.raises(LayoutError, match=r"token\(s\) \['xp'\]") as info:
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xp-dp")
    assert info.value.upstream == "KeyError"
    with pytest.raises(LayoutError, match=r"repeats \['tp'\]"):
        RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-tp-dp")
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(LayoutError, match="not in order") as info:
        gen.get_ranks("sp")
    assert info.value.upstream == "ValueError"


# -- initialize_model_parallel: literal cases ------------------------------------------------


def test_docstring_example_16_gpus_tp2_pp4() -> None:
    exp = expect(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert exp.groups("dp") == Groups(
        [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    )
    assert exp.groups("tp") == Groups([(2 * i, 2 * i + 1) for i in range(8)])
    assert exp.groups("pp") == Groups(
        [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    )
    assert exp.groups("embedding") == Groups([(0, 12), (1, 13), (2, 14), (3, 15)])
    assert exp.groups("position_embedding") == Groups([(0,), (1,), (2,), (3,)])
    assert exp.groups("tp-pp") == Groups([(0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)])


def test_context_parallel_docstring_example() -> None:
    # 8 GPUs, tp 4, cp 2: cp groups [0, 4], [1, 5], [2, 6], [3, 7].
    exp = expect(8, tensor_model_parallel_size=4, context_parallel_size=2)
    assert exp.groups("cp") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert exp.groups("dp") == Groups([(i,) for i in range(8)])
    assert exp.groups("dp-cp") == exp.groups("cp")
    assert exp.groups("tp-cp") == Groups([tuple(range(8))])


def test_expert_groups_literal() -> None:
    exp = expect(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    assert exp.groups("expert:tp") == Groups([(i,) for i in range(8)])
    assert exp.groups("expert:ep") == Groups([(0, 1), (2, 3), (4, 5), (6, 7)])
    assert exp.groups("expert:dp") == Groups([(0, 2, 4, 6), (1, 3, 5, 7)])
    assert exp.groups("dp") == Groups([(0, 2, 4, 6), (1, 3, 5, 7)])
    # Default etp is the dense tp: ep groups stride over tp.
    exp = expect(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert exp.config["expert_tensor_parallel_size"] == 2
    assert exp.groups("expert:ep") == Groups([(0, 2), (1, 3), (4, 6), (5, 7)])
    assert exp.groups("expert:tp-ep") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert exp.groups("expert:dp") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])


def test_world16_tp2_pp2_cp2_order_tp_cp_pp_ep_dp_is_rejected() -> None:
    with pytest.raises(LayoutError, match="dense dp = 2 and expert dp = 4") as info:
        expect(
            16,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            context_parallel_size=2,
            order="tp-cp-pp-ep-dp",
        )
    assert info.value.upstream == "AssertionError"
    # The pp-last order of the same sizes is fine.
    expect(
        16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2
    )


def test_pp_last_check_reads_the_order_as_given() -> None:
    # Upstream lowercases the order for the generators but tests `order.endswith("pp")` as given.
    config = dict(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2
    )
    expect(16, order="tp-cp-ep-dp-pp", **config)
    with pytest.raises(LayoutError, match="does not end with 'pp'"):
        expect(16, order="TP-CP-EP-DP-PP", **config)


def test_dense_and_expert_pipelines_must_match() -> None:
    # edp == dp passes the pp-last check, but the pp strides differ (tp 2 vs etp 1).
    with pytest.raises(LayoutError, match="different pipeline groups") as info:
        expect(
            8,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            order="tp-pp-ep-dp",
        )
    assert info.value.upstream == "AssertionError"


def test_partial_distributed_optimizer_groups() -> None:
    exp = expect(8, num_distributed_optimizer_instances=2)
    assert exp.groups("intra_dp_cp") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert exp.groups("expert:intra_dp") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert exp.groups("expert:inter_dp") == Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert exp.groups("intra_dist_opt_instance") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    exp = expect(16, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    assert exp.groups("intra_dp_cp") == Groups(
        [(0, 2, 4, 6), (8, 10, 12, 14), (1, 3, 5, 7), (9, 11, 13, 15)]
    )
    assert exp.groups("intra_dist_opt_instance") == Groups([tuple(range(8)), tuple(range(8, 16))])
    # Released 0.16.1 (unlike the conventions notes) sets the partial getters with one instance
    # too: they span the whole dp-cp / expert dp group, the instance is the world; no inter group.
    one = expect(8, tensor_model_parallel_size=2)
    assert one.groups("intra_dp_cp") == one.groups("dp-cp")
    assert one.groups("expert:intra_dp") == one.groups("expert:dp")
    assert one.groups("intra_dist_opt_instance") == Groups([tuple(range(8))])
    assert "expert:inter_dp" not in one.kinds()


def test_hierarchical_cp_docstring_example() -> None:
    exp = expect(16, context_parallel_size=16, hierarchical_context_parallel_sizes=[2, 2, 4])
    assert exp.groups("hierarchical_cp:0") == Groups([(2 * i, 2 * i + 1) for i in range(8)])
    assert exp.groups("hierarchical_cp:1") == Groups(
        [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    )
    assert exp.groups("hierarchical_cp:2") == Groups(
        [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    )
    # Levels apply inside each cp group (tp 2 makes cp strided).
    levels = hierarchical_groups(np.array([[0, 2, 4, 6]]), [2, 2])
    assert [level.tolist() for level in levels] == [[[0, 2], [4, 6]], [[0, 4], [2, 6]]]
    with pytest.raises(LayoutError, match=r"sizes \[2, 3\] do not multiply to group size 4"):
        hierarchical_groups(np.array([[0, 2, 4, 6]]), [2, 3])


def test_hybrid_dp_cp_groups() -> None:
    exp = expect(8, context_parallel_size=2, hybrid_context_parallel=True)
    assert exp.groups("hybrid_dp_cp:2") == Groups([(0, 1), (2, 3), (4, 5), (6, 7)])
    assert exp.groups("hybrid_dp_cp:4") == Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert "hybrid_dp_cp:8" not in exp.kinds()
    assert hybrid_sizes(8) == [2, 4]
    assert hybrid_sizes(12) == [2, 4]
    assert hybrid_sizes(10) == [2]  # upstream's size-4 chunks of 10 are ragged: left out
    assert hybrid_sizes(2) == []


def test_custom_embedding_ranks() -> None:
    exp = expect(
        8,
        pipeline_model_parallel_size=4,
        get_embedding_ranks=lambda ranks: [ranks[0], ranks[2], ranks[-1]],
        get_position_embedding_ranks=lambda ranks: ranks[:2],
    )
    assert exp.groups("embedding") == Groups([(0, 4, 6), (1, 5, 7)])
    assert exp.groups("position_embedding") == Groups([(0, 2), (1, 3)])
    assert not exp.kind("embedding").partition
    ragged = expect(
        8,
        pipeline_model_parallel_size=4,
        get_embedding_ranks=lambda ranks: ranks[: 1 + ranks[0] % 2],
    )
    with pytest.raises(LayoutError, match="different sizes"):
        ragged.groups("embedding")


def test_embedding_is_a_partition_only_for_one_or_two_stages() -> None:
    assert expect(4, pipeline_model_parallel_size=1).kind("embedding").partition
    assert expect(4, pipeline_model_parallel_size=2).kind("embedding").partition
    assert not expect(4, pipeline_model_parallel_size=4).kind("embedding").partition
    assert expect(4, pipeline_model_parallel_size=1).groups("embedding") == Groups(
        [(0,), (1,), (2,), (3,)]
    )


def test_roles() -> None:
    exp = expect(8, tensor_model_parallel_size=2, context_parallel_size=2)
    assert dict(exp.roles) == {
        "data_parallel": "dp",
        "gradient_reduce": "dp-cp",
        "tensor": "tp",
        "context": "cp",
        "pipeline": "pp",
        "embedding": "embedding",
        "loss": "dp-cp",
        "expert": "expert:ep",
        "expert_data": "expert:dp",
    }
    assert exp.groups("gradient_reduce") == exp.groups("dp-cp")


def test_kinds_follow_creation_order() -> None:
    exp = expect(
        8,
        num_distributed_optimizer_instances=2,
        context_parallel_size=2,
        hierarchical_context_parallel_sizes=[2],
        hybrid_context_parallel=True,
    )
    assert list(exp.kinds()) == [
        "dp-cp",
        "dp-cp:gloo",
        "intra_dp_cp",
        "intra_dp_cp:gloo",
        "hybrid_dp_cp:2",
        "hybrid_dp_cp:4",
        "dp",
        "dp:gloo",
        "cp",
        "hierarchical_cp:0",
        "tp-pp",
        "tp",
        "pp",
        "embedding",
        "position_embedding",
        "tp-dp-cp",
        "tp-dp",
        "tp-cp",
        *EXPERT,
        "expert:dp:gloo",
        "expert:intra_dp",
        "expert:intra_dp:gloo",
        "expert:inter_dp",
        "intra_dist_opt_instance",
    ]
    assert list(exp.unavailable()) == ["dp-cp:ag"]  # create_all_gather_group defaults to False


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "config", "upstream", "message"),
    [
        (
            8,
            {"tensor_model_parallel_size": 3},
            "RuntimeError",
            r"world_size 8 is not divisible by .* = 3",
        ),
        (
            8,
            {
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "context_parallel_size": 4,
            },
            "RuntimeError",
            r"2×2×4 = 16",
        ),
        (
            8,
            {"virtual_pipeline_model_parallel_size": 2},
            "RuntimeError",
            "needs pipeline_model_parallel_size > 1, got 1",
        ),
        (
            8,
            {"context_parallel_size": 2, "order": "tp-dp-pp"},
            "RuntimeError",
            "leaves out 'cp', whose size is 2",
        ),
        (8, {"expert_model_parallel_size": 3}, "RuntimeError", r"1×3×1 = 3"),
        (
            8,
            {"expert_model_parallel_size": 2, "order": "tp-cp-dp-pp"},
            "RuntimeError",
            "leaves out 'ep'",
        ),
        (8, {"order": "tp-cp-ep-dp-mp"}, "KeyError", "does not know"),
        (
            8,
            {"num_distributed_optimizer_instances": 3},
            "AssertionError",
            "dp×cp = 8×1 = 8 is not divisible by num_distributed_optimizer_instances=3",
        ),
        (
            3,
            {"context_parallel_size": 3, "hybrid_context_parallel": True},
            "AssertionError",
            "even dp×cp group, got 1×3 = 3",
        ),
        (
            8,
            {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 3]},
            "AssertionError",
            r"multiply to 6, not context_parallel_size=4",
        ),
        (
            8,
            {
                "context_parallel_size": 2,
                "expert_model_parallel_size": 4,
                "expert_tensor_parallel_size": 1,
                "num_distributed_optimizer_instances": 4,
            },
            "AssertionError",
            "expert data-parallel size 2 is not divisible",
        ),
    ],
)
def test_errors(world: int, config: dict[str, object], upstream: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        expect(world, **config)
    assert info.value.upstream == upstream


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"tensor_parallel": 2}, "takes no config key"),
        ({"tensor_model_parallel_size": 0}, "integer >= 1, got 0"),
        ({"pipeline_model_parallel_size": True}, "integer >= 1, got True"),
        ({"expert_tensor_parallel_size": 1.5}, "integer >= 1"),
        ({"hierarchical_context_parallel_sizes": "22"}, "list of integers"),
        ({"hierarchical_context_parallel_sizes": 2}, "list of integers"),
        ({"order": 5}, "order must be a string"),
    ],
)
def test_meshsim_config_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        expect(8, **config)


# -- pipeline first / last / next / prev ----------------------------------------------------


def test_first_pipeline_rank_is_rank_mod_tp() -> None:
    # megatron's test_pipeline_parallel_initializations: world 8, tp 2, pp 4.
    exp = expect(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    for rank in range(8):
        ranks = pipeline_ranks(exp, rank)
        assert ranks.first == rank % 2
        assert ranks.last == rank % 2 + 6
        assert ranks.next == (rank + 2) % 8
        assert ranks.prev == (rank - 2) % 8
    assert pipeline_ranks(exp, 3) == PipelineRanks(first=1, last=7, next=5, prev=1)


@settings(max_examples=60, deadline=None)
@given(split_world())
def test_pipeline_ranks_for_pp_last_orders(case: tuple[int, dict[str, Any]]) -> None:
    world, config = case
    config["order"] = config["order"].replace("-pp", "").replace("pp-", "") + "-pp"
    try:
        exp = expect(world, **config)
    except LayoutError:
        return
    stride = world // config["pipeline_model_parallel_size"]
    for rank in range(world):
        ranks = pipeline_ranks(exp, rank)
        assert ranks.first == rank % stride
        assert ranks.last == rank % stride + world - stride
        assert ranks.next == (rank + stride) % world
        assert ranks.prev == (rank - stride) % world


# -- properties --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(split_world())
def test_every_config_partitions_or_fails_with_upstream(case: tuple[int, dict[str, Any]]) -> None:
    world, config = case
    try:
        exp = expect(world, **config)
    except LayoutError as error:
        assert error.upstream in {"RuntimeError", "AssertionError"}
        return
    tp, cp, pp, ep, etp = (config[k] for k in SIZE_KEYS)
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    sizes = {
        "dp": dp,
        "dp-cp": dp * cp,
        "cp": cp,
        "tp": tp,
        "pp": pp,
        "tp-pp": tp * pp,
        "tp-dp": tp * dp,
        "tp-dp-cp": tp * dp * cp,
        "tp-cp": tp * cp,
        "expert:ep": ep,
        "expert:tp": etp,
        "expert:tp-ep": etp * ep,
        "expert:tp-ep-pp": etp * ep * pp,
        "expert:dp": edp,
    }
    for kind, size in sizes.items():
        groups = exp.groups(kind)
        assert groups.group_size == size, kind
        assert groups.is_partition_of(world), kind
    for name in exp.kinds():
        kind = exp.kind(name)
        assert kind.groups().is_partition_of(world) == kind.partition, name


@settings(max_examples=100, deadline=None)
@given(split_world(max_world=48))
def test_groups_equal_megatron_loops_in_megatron_order(case: tuple[int, dict[str, Any]]) -> None:
    """Every dense and expert kind equals the loop algorithm over the order's sizes, list for
    list (same group order, same order inside groups)."""
    world, config = case
    try:
        exp = expect(world, **config)
    except LayoutError:
        return
    tp, cp, pp, ep, etp = (config[k] for k in SIZE_KEYS)
    dense = {"tp": tp, "cp": cp, "pp": pp, "ep": 1, "dp": world // (tp * cp * pp)}
    expert = {"tp": etp, "cp": 1, "pp": pp, "ep": ep, "dp": world // (etp * ep * pp)}
    order = config["order"].split("-")
    for kinds, size in ((DENSE, dense), (EXPERT, expert)):
        for kind in kinds:
            mask = [t in kind.removeprefix("expert:").split("-") for t in order]
            reference = reference_groups([size[t] for t in order], mask)
            assert exp.groups(kind).array.tolist() == reference, kind


def test_default_order_equals_torch_mesh_pp_dp_cp_tp() -> None:
    """Order tp-cp-dp-pp is init_device_mesh((pp, dp, cp, tp)), for every world up to 64."""
    ops = [
        "flatten dp,cp -> dp_cp",
        "flatten pp,tp -> pp_tp",
        "flatten dp,tp -> dp_tp",
        "flatten dp,cp,tp -> dp_cp_tp",
        "flatten cp,tp -> cp_tp",
    ]
    same = {
        "dp": "dp",
        "cp": "cp",
        "tp": "tp",
        "pp": "pp",
        "dp-cp": "dp_cp",
        "tp-pp": "pp_tp",
        "tp-dp": "dp_tp",
        "tp-dp-cp": "dp_cp_tp",
        "tp-cp": "cp_tp",
    }
    checked = 0
    for world in range(1, 65):
        for pp, dp, cp, tp in ordered_factorizations(world, 4):
            exp = expect(
                world,
                tensor_model_parallel_size=tp,
                context_parallel_size=cp,
                pipeline_model_parallel_size=pp,
                order="tp-cp-dp-pp",
            )
            torch = meshsim.expect(
                "torch",
                world,
                mesh_shape=(pp, dp, cp, tp),
                mesh_dim_names=("pp", "dp", "cp", "tp"),
                ops=ops,
            )
            layout = Layout(pp=pp, dp=dp, cp=cp, tp=tp)
            for ours, theirs in same.items():
                assert exp.groups(ours) == torch.groups(theirs), (world, pp, dp, cp, tp, ours)
            assert exp.groups("dp-cp") == layout.groups("dp", "cp")
            checked += 1
    assert checked > 1000


def test_the_two_default_orders_differ_only_outside_tp_cp_ep() -> None:
    config = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=2,
    )
    a = expect(16, order="tp-cp-ep-dp-pp", **config)
    b = expect(16, order="tp-cp-ep-pp-dp", **config)
    for kind in ("tp", "cp", "tp-cp", "expert:tp", "expert:ep", "expert:tp-ep"):
        assert a.groups(kind) == b.groups(kind), kind
    for kind in ("dp", "dp-cp", "pp", "tp-pp", "tp-dp", "expert:dp", "expert:tp-ep-pp"):
        assert a.groups(kind) != b.groups(kind), kind
    assert a.groups("pp") == Groups([(i, i + 8) for i in range(8)])
    assert b.groups("pp") == Groups([(i, i + 4) for i in (0, 1, 2, 3, 8, 9, 10, 11)])
    # With ep = cp the expert grid puts ep exactly where the dense grid has cp.
    assert a.groups("expert:ep") == a.groups("cp")


# -- configs -------------------------------------------------------------------------------------


def test_configs_world_8() -> None:
    cases = list(megatron.configs(8, hyper_comm_grid=False, options=False))
    assert 100 < len(cases) <= 300
    assert {c["order"] for c in cases} == {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"}
    assert len({tuple(sorted(c.items())) for c in cases}) == len(cases)
    for case in cases:
        expect(8, **case)  # every config yielded is valid
    # pp-not-last configs need equal dense and expert dp.
    for case in cases:
        if case["order"] == "tp-cp-ep-pp-dp" and case["pipeline_model_parallel_size"] > 1:
            assert (
                case["expert_tensor_parallel_size"] * case["expert_model_parallel_size"]
                == case["tensor_model_parallel_size"] * case["context_parallel_size"]
            )


def test_configs_options() -> None:
    dense = list(megatron.configs(8, expert=False, orders=["tp-dp-pp"]))
    assert len(dense) == len(list(ordered_factorizations(8, 4))) - sum(
        1 for _tp, cp, _pp, _dp in ordered_factorizations(8, 4) if cp > 1
    )
    assert all(c["expert_model_parallel_size"] == 1 for c in dense)
    every = list(megatron.configs(4, all_orders=True, expert=False))
    assert {c["order"] for c in every} == {"-".join(p) for p in itertools.permutations(AXES)}
    assert meshsim.layouts(8, "megatron", orders=["tp-dp-pp"], expert=False)[0].id.startswith(
        "megatron-8-tp=1-cp=1-pp=1"
    )


def test_registry_and_normalised_config() -> None:
    exp = meshsim.expect("megatron", 4, tensor_model_parallel_size=2)
    assert exp.framework == "megatron"
    assert exp.config["order"] == "tp-cp-ep-dp-pp"
    assert exp.config["expert_tensor_parallel_size"] == 2
    assert exp.layout is not None and exp.layout.root_names[-1] == "tp"


# -- gloo twins and the all-gather group ---------------------------------------------------------

TWINS = {
    "dp-cp:gloo": "dp-cp",
    "intra_dp_cp:gloo": "intra_dp_cp",
    "dp:gloo": "dp",
    "expert:dp:gloo": "expert:dp",
    "expert:intra_dp:gloo": "expert:intra_dp",
}


def test_gloo_twins_hold_the_ranks_of_their_groups_by_default() -> None:
    """World 8, tp 2, ep 2, two optimizer instances (worked out from parallel_state): dp-cp is
    (0, 2, 4, 6), (1, 3, 5, 7); an instance takes half of each; expert dp (etp 2 × ep 2 = 4
    ranks per expert model group) is (0, 4), ...; halved, one rank each."""
    exp = expect(
        8,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_distributed_optimizer_instances=2,
    )
    assert exp.groups("dp:gloo").to_tuples() == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert exp.groups("intra_dp_cp:gloo").to_tuples() == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert exp.groups("expert:dp:gloo").to_tuples() == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert sorted(exp.groups("expert:intra_dp:gloo")) == [(r,) for r in range(8)]
    for twin, base in TWINS.items():
        assert exp.groups(twin) == exp.groups(base)
        assert "gloo" in exp.kinds()[twin]  # described by its getter
    assert exp.config["create_gloo_process_groups"] is True


def test_twins_not_made_are_getters_that_assert() -> None:
    exp = expect(8, tensor_model_parallel_size=2, create_gloo_process_groups=False)
    assert sorted(exp.unavailable()) == sorted([*TWINS, "dp-cp:ag"])
    with pytest.raises(LayoutError) as error:
        exp.groups("dp:gloo")
    assert error.value.upstream == "AssertionError"
    assert "create_gloo_process_groups=False" in str(error.value)


def test_all_gather_group_is_a_second_dp_cp() -> None:
    exp = expect(16, context_parallel_size=2, create_all_gather_group=True)
    assert exp.groups("dp-cp:ag") == exp.groups("dp-cp")
    assert exp.groups("dp-cp:ag")[0] == tuple(range(16))
    assert list(exp.kinds())[:3] == ["dp-cp", "dp-cp:ag", "dp-cp:gloo"]


@pytest.mark.parametrize("key", ["create_gloo_process_groups", "create_all_gather_group"])
def test_switches_must_be_booleans(key: str) -> None:
    with pytest.raises(LayoutError, match=f"{key} must be True or False") as error:
        expect(8, **{key: 1})
    assert error.value.upstream is None


# -- HyperCommGrid -------------------------------------------------------------------------------


def grid(shape: list[int], names: list[str], pgs: list[Any], **extra: Any) -> dict[str, Any]:
    return {"hyper_comm_grid": {"shape": shape, "dim_names": names, "pgs": pgs, **extra}}


def grid_groups(exp: meshsim.Expected) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {
        k[len("hyper_comm_grid[") : -1]: exp.groups(k).to_tuples()
        for k in exp.kinds()
        if k.startswith("hyper_comm_grid[")
    }


def test_grid_keys_follow_reversed_dim_names_world_8() -> None:
    """Grid [2, 2, 2] over a, b, c: rank = a + 2b + 4c (a fastest, as the order string). A list
    is reordered slowest first for the key; groups list ranks ascending."""
    exp = expect(8, **grid([2, 2, 2], ["a", "b", "c"], [["a", "b"], ["c", "a"], "b", ["c"]]))
    assert grid_groups(exp) == {
        "b-a": ((0, 1, 2, 3), (4, 5, 6, 7)),
        "c-a": ((0, 1, 4, 5), (2, 3, 6, 7)),
        "b": ((0, 2), (1, 3), (4, 6), (5, 7)),
        "c": ((0, 4), (1, 5), (2, 6), (3, 7)),
    }
    assert "create_pg(['c', 'a'])" in exp.kinds()["hyper_comm_grid[c-a]"]
    assert exp.kind("hyper_comm_grid[b]").partition


def test_grid_with_rank_offset_leaves_the_lower_ranks_out_world_16() -> None:
    """Grid [2, 4] over tp, dp from rank 8: rank = 8 + tp + 2 dp; ranks 0-7 hold no group."""
    exp = expect(16, **grid([2, 4], ["tp", "dp"], ["tp", "dp", ["dp", "tp"]], rank_offset=8))
    assert grid_groups(exp) == {
        "tp": ((8, 9), (10, 11), (12, 13), (14, 15)),
        "dp": ((8, 10, 12, 14), (9, 11, 13, 15)),
        "dp-tp": (tuple(range(8, 16)),),
    }
    assert exp.group_of(3, "hyper_comm_grid[tp]") is None
    assert exp.group_of(13, "hyper_comm_grid[dp]") == (9, 11, 13, 15)
    assert not exp.kind("hyper_comm_grid[tp]").partition
    assert exp.config["hyper_comm_grid"]["rank_offset"] == 8


def test_grid_docstring_example_equals_parallel_state() -> None:
    """Upstream's example: HyperCommGrid([2, 3, 4, 5], [tp, cp, pp, dp]) on 120 ranks is said
    to equal initialize_model_parallel(tp=2, cp=3, pp=4, order="tp-cp-pp-dp"). As written,
    megatron-core 0.16.1 refuses that call (pp is not last, and the expert dp, 120 / (etp 2 × pp
    4) = 15, is not the dense dp 5); with etp = tp × cp = 6 it builds, and the groups agree."""
    config = grid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"], ["dp", ["cp", "dp"], ["tp", "pp"]])
    sizes = {
        "tensor_model_parallel_size": 2,
        "context_parallel_size": 3,
        "pipeline_model_parallel_size": 4,
        "order": "tp-cp-pp-dp",
    }
    with pytest.raises(LayoutError, match="dense dp = 5 and expert dp = 15") as error:
        expect(120, **sizes, **config)
    assert error.value.upstream == "AssertionError"
    exp = expect(120, **sizes, expert_tensor_parallel_size=6, **config)
    assert exp.groups("hyper_comm_grid[dp]") == exp.groups("dp")
    assert exp.groups("hyper_comm_grid[dp-cp]") == exp.groups("dp-cp")
    assert exp.groups("hyper_comm_grid[pp-tp]") == exp.groups("tp-pp")
    assert exp.groups("hyper_comm_grid[dp]")[0] == (0, 24, 48, 72, 96)


@pytest.mark.parametrize("world", [8, 16])
def test_every_grid_config_agrees_with_parallel_state(world: int) -> None:
    """A grid over (tp, cp, dp, pp) is the order tp-cp-dp-pp: each create_pg naming a megatron
    token's dims gives that token's groups (key = the dims slowest first)."""
    tokens = {"dp-cp": "dp-cp", "dp": "dp", "cp": "cp", "pp-tp": "tp-pp", "tp": "tp", "pp": "pp"}
    tokens |= {"dp-cp-tp": "tp-dp-cp", "dp-tp": "tp-dp", "cp-tp": "tp-cp"}
    full = [c for c in megatron.grid_configs(world) if "order" in c]
    assert len(full) == len(list(ordered_factorizations(world, 4)))
    for config in full:
        exp = expect(world, **config)
        assert len(grid_groups(exp)) == 15
        for key, token in tokens.items():
            assert exp.groups(f"hyper_comm_grid[{key}]") == exp.groups(token), (config, key)
        assert exp.groups("hyper_comm_grid[pp-dp-cp-tp]")[0] == tuple(range(world))


def test_grid_configs_are_listed_after_the_parallel_state_sweep() -> None:
    cases = meshsim.layouts(8, "megatron")
    grids = [c for c in cases if "hyper_comm_grid" in c.config]
    assert len(grids) == 20 + 3  # 4-dim factorizations of 8, then 2-dim ones of 4 at offset 4
    assert cases[-len(grids) :] == grids
    assert grids[-1].id == (
        "megatron-8-hyper_comm_grid={shape:[4,1],dim_names:[tp,dp],rank_offset:4,"
        "pgs:[tp,dp,[dp,tp]]}"
    )
    assert not [c for c in megatron.configs(8, orders=[DEFAULT]) if "hyper_comm_grid" in c]


DEFAULT = megatron.DEFAULT_ORDER
AB = (["a", "b"], [2, 2])


@pytest.mark.parametrize(
    ("spec", "upstream", "message"),
    [
        ({"shape": [2], "dim_names": ["a", "b"]}, "ValueError", "has 1 dims"),
        ({"shape": [2, 2], "dim_names": AB[0], "rank_offset": -1}, "ValueError", ">= 0"),
        ({"shape": [4, 4], "dim_names": AB[0]}, "RuntimeError", "holds 16 ranks"),
        ({"shape": [2, 2], "dim_names": AB[0], "rank_offset": 5}, "RuntimeError", "more than"),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": [["a", "c"]]}, "ValueError", "['c']"),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": [[]]}, "TypeError", "no dim"),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": ["a", ["a"]]}, "KeyError", "already"),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": [["b", "a"], ["a", "b"]]}, "KeyError", ""),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": ["c"]}, "EinopsError", "names no dim"),
        ({"shape": [2, 2], "dim_names": AB[0], "pgs": [["a", "a"]]}, "EinopsError", "twice"),
        ({"shape": [2, 2], "dim_names": ["a", "a"], "pgs": ["a"]}, "EinopsError", "repeat"),
        ({"shape": [2, 2], "dim_names": ["_a", "b"], "pgs": ["b"]}, "EinopsError", "einops"),
        ({"shape": [2, 2], "dim_names": ["a-b", "c"], "pgs": ["c"]}, "EinopsError", "einops"),
    ],
)
def test_grid_refusals_name_the_framework_exception(
    spec: dict[str, Any], upstream: str, message: str
) -> None:
    with pytest.raises(LayoutError) as error:
        expect(8, hyper_comm_grid=spec)
    assert error.value.upstream == upstream
    assert message in str(error.value)


def test_grid_refusals_wait_for_create_pg() -> None:
    """Names einops would refuse, and repeated ones, pass until a create_pg enumerates them."""
    exp = expect(8, hyper_comm_grid={"shape": [2, 4], "dim_names": ["_x", "_x"]})
    assert not [k for k in exp.kinds() if k.startswith("hyper_comm_grid")]
    # A stored key is refused before einops looks at the dims.
    with pytest.raises(LayoutError) as error:
        expect(8, **grid([2, 4], ["cp", "tp"], [["cp", "tp"], "tp-cp"]))
    assert error.value.upstream == "KeyError"


def test_parallel_state_refusals_come_before_the_grid() -> None:
    with pytest.raises(LayoutError) as error:
        expect(8, tensor_model_parallel_size=3, hyper_comm_grid={"shape": [9], "dim_names": ["a"]})
    assert error.value.upstream == "RuntimeError" and "divisible" in str(error.value)


@pytest.mark.parametrize(
    "spec",
    [
        [2, 4],
        {"shape": [2, 4]},
        {"shape": [2, 4], "dim_names": ["a", "b"], "pg": ["a"]},
        {"shape": [0, 4], "dim_names": ["a", "b"]},
        {"shape": [2.0, 4], "dim_names": ["a", "b"]},
        {"shape": "24", "dim_names": ["a", "b"]},
        {"shape": [2, 4], "dim_names": ["a", 1]},
        {"shape": [2, 4], "dim_names": ["a", "b"], "pgs": [["a", 1]]},
        {"shape": [2, 4], "dim_names": ["a", "b"], "rank_offset": True},
    ],
)
def test_grid_config_errors_are_meshsims_own(spec: Any) -> None:
    with pytest.raises(LayoutError, match="hyper_comm_grid") as error:
        expect(8, hyper_comm_grid=spec)
    assert error.value.upstream is None


def test_grid_pgs_from_the_command_line_are_tuples() -> None:
    """``--hyper-comm-grid '{...}'`` parses JSON lists as tuples: the same calls as lists."""
    as_lists = expect(8, **grid([2, 4], ["tp", "dp"], [["dp", "tp"]]))
    as_tuples = expect(8, hyper_comm_grid={"shape": (2, 4), "dim_names": ("tp", "dp"),
                                           "pgs": (("dp", "tp"),)})  # fmt: skip
    assert grid_groups(as_lists) == grid_groups(as_tuples) == {"dp-tp": (tuple(range(8)),)}
