"""Invariant checks catch the layouts that fail silently in training."""

from __future__ import annotations

import pytest

import meshsim
from meshsim import Groups, Layout, LayoutError
from meshsim.model.expected import Expected, Kind, layout_kind
from meshsim.model.invariants import (
    crossing_groups,
    find_violations,
    is_contained,
    node_crossings,
    peers_with_different_local_rank,
    pipeline_neighbors_mismatch,
    uncontained_groups,
    validate_invariants,
)


def _expected(kinds: list[Kind], roles: dict[str, str], world: int = 8) -> Expected:
    return Expected("test", world, {}, kinds, roles)


def test_containment() -> None:
    data = Groups([(0, 2), (1, 3), (4, 6), (5, 7)])
    grad = Groups([(0, 1, 2, 3), (4, 5, 6, 7)])
    assert is_contained(data, grad, 8)
    split = Groups([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert uncontained_groups(split, grad, 8) == split


def test_tp_peers_fed_different_batches_are_caught() -> None:
    layout = Layout(dp=2, tp=4)
    data = layout.groups("dp")
    assert len(peers_with_different_local_rank(layout.groups("tp"), data, 8)) == 0
    # A wrong data-parallel grouping: consecutive ranks, so TP peers hold different dp ranks.
    wrong_data = Groups([(0, 1), (2, 3), (4, 5), (6, 7)])
    bad = peers_with_different_local_rank(layout.groups("tp"), wrong_data, 8)
    assert bad == layout.groups("tp")


def test_node_crossing_tp() -> None:
    layout = Layout(dp=2, tp=8)
    assert len(crossing_groups(layout.groups("tp"), gpus_per_node=8)) == 0
    assert crossing_groups(layout.groups("tp"), gpus_per_node=4) == layout.groups("tp")
    expected = meshsim.expect("torch", 16, mesh_shape=(2, 8), mesh_dim_names=("dp", "tp"))
    crossings = node_crossings(expected, gpus_per_node=8)
    assert set(crossings) == {"dp"} and len(crossings["dp"]) == 8
    with pytest.raises(LayoutError, match="gpus_per_node must be >= 1"):
        crossing_groups(layout.groups("tp"), 0)


def test_correct_torch_layout_has_no_violations() -> None:
    expected = meshsim.expect(
        "torch",
        16,
        mesh_shape=(2, 2, 2, 2),
        mesh_dim_names=("pp", "dp", "cp", "tp"),
        ops=["flatten dp,cp"],
    )
    assert find_violations(expected) == []
    validate_invariants(expected)


def test_broken_layout_reports_each_violation() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    kinds = [
        layout_kind(layout, "tp", "tp", "tp"),
        # pipelines pairing ranks with different tp positions.
        Kind("pp", "wrong", Groups([(0, 5), (1, 4), (2, 7), (3, 6)])),
        # gradient reduction over pp instead of dp: does not contain the dp groups.
        layout_kind(layout, "grad", "wrong", "pp"),
        # data parallel over consecutive ranks: tp peers load different batches.
        Kind("dp", "wrong", Groups([(0, 1), (2, 3), (4, 5), (6, 7)])),
        Kind("holes", "not a partition", Groups([(0, 1)])),
    ]
    roles = {"tensor": "tp", "pipeline": "pp", "gradient_reduce": "grad", "data_parallel": "dp"}
    found = find_violations(_expected(kinds, roles))
    checks = {v.check for v in found}
    assert "partition" in checks
    assert "gradient_reduce ⊇ data_parallel" in checks
    assert "tensor peers share the data-parallel rank" in checks
    assert "pipeline neighbours" in checks
    with pytest.raises(LayoutError, match=r"breaks .* invariant"):
        validate_invariants(_expected(kinds, roles))


def test_kinds_sharing_a_family_each_report_its_partition_break() -> None:
    """Kinds that share one family object (torchtitan's getters, ``Kind.renamed``) are each
    checked: a family that is no partition is named under every kind that hands it out, and
    the one that does not ask for a partition is not."""
    holes = Kind("holes", "not a partition", Groups([(0, 1)]))
    kinds = [
        Kind("whole", "the world", Groups([tuple(range(8))])),
        holes,
        holes.renamed("holes again", "the same family under another name"),
        Kind("holes, not asked", "no partition asked", holes.groups(), partition=False),
    ]
    found = find_violations(_expected(kinds, {}))
    assert [(v.check, v.kind) for v in found] == [
        ("partition", "holes"),
        ("partition", "holes again"),
    ]
    assert kinds[2].groups() is holes.groups()


def test_pipeline_neighbours_must_differ_only_in_stage() -> None:
    layout = Layout(pp=2, tp=2)
    good = _expected(
        [layout_kind(layout, "pp", "", "pp"), layout_kind(layout, "tp", "", "tp")],
        {"pipeline": "pp", "tensor": "tp"},
        world=4,
    )
    assert pipeline_neighbors_mismatch(good) == []
    crossed = _expected(
        [Kind("pp", "", Groups([(0, 3), (1, 2)])), layout_kind(layout, "tp", "", "tp")],
        {"pipeline": "pp", "tensor": "tp"},
        world=4,
    )
    assert pipeline_neighbors_mismatch(crossed)
    assert crossed.pipeline_neighbors(3) == (0, 0)


# -- gradient_reduce ⊇ data_parallel / context: peers whose gradients nothing reduces -----------
def _checks(expected: Expected) -> dict[str, str]:
    return {v.check: v.kind for v in find_violations(expected)}


def test_accelerate_multi_gpu_with_tp_never_reduces_its_replicas() -> None:
    """``prepare_model`` wraps DDP only without TP: two loader replicas and no gradient group."""
    planted = meshsim.expect(
        "accelerate", 8, dp_shard_size=2, tp_size=4, distributed_type="MULTI_GPU"
    )
    assert "gradient_reduce" not in planted.roles and not planted.unknown_roles
    (violation,) = find_violations(planted)
    assert (violation.check, violation.kind) == (
        "gradient_reduce ⊇ data_parallel",
        "dataloader_replica",
    )
    assert violation.message == (
        "data-parallel groups [(0, 4), (1, 5), (2, 6), ... 1 more] are in no gradient-reduce group"
    )
    assert "replicas train apart" in violation.consequence
    # The same sizes under FSDP2 reduce over fsdp_mesh; TP alone has no replicas to reduce.
    assert find_violations(meshsim.expect("accelerate", 8, dp_shard_size=2, tp_size=4)) == []
    assert find_violations(meshsim.expect("accelerate", 8, tp_size=8)) == []


def test_accelerate_deepspeed_reduces_over_groups_the_reference_leaves_unknown() -> None:
    """DeepSpeed's engine reduces over its own group: no finding, though accelerate builds none."""
    expected = meshsim.expect("accelerate", 8, dp_shard_size=8, distributed_type="DEEPSPEED")
    assert "DeepSpeed's engine" in expected.unknown_roles["gradient_reduce"]
    assert find_violations(expected) == []
    # The same layout with the role absent rather than unknown is flagged: the rule fires.
    kinds = [expected.kind(name) for name in expected.kinds()]
    absent = _expected(kinds, dict(expected.roles))
    assert set(_checks(absent)) == {"gradient_reduce ⊇ data_parallel"}


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_verl_ulysses_peers_on_one_rank_reduce_groups_are_flagged(sp: int) -> None:
    """verl#7493: FSDP1 NO_SHARD over one rank; the Ulysses peers' partial gradients never meet.
    At sp = world the data-parallel groups are single ranks: only the context check sees it."""
    planted = meshsim.expect("verl", 8, fsdp_size=1, ulysses_sequence_parallel_size=sp)
    found = _checks(planted)
    assert found["gradient_reduce ⊇ context"] == "sp"
    assert ("gradient_reduce ⊇ data_parallel" in found) == (sp < 8)
    (context,) = [v for v in find_violations(planted) if v.check == "gradient_reduce ⊇ context"]
    assert context.message.endswith("are split across fsdp_reduce groups")
    assert "partial gradient" in context.consequence
    for sound in ({"strategy": "fsdp2", "fsdp_size": 1}, {"fsdp_size": 2}, {}):
        assert (
            find_violations(meshsim.expect("verl", 8, ulysses_sequence_parallel_size=sp, **sound))
            == []
        )


def test_context_peers_without_any_gradient_group_are_flagged() -> None:
    layout = Layout(dp=2, cp=4)
    kinds = [layout_kind(layout, "dp", "", "dp"), layout_kind(layout, "cp", "", "cp")]
    bare = _expected(kinds, {"data_parallel": "dp", "context": "cp"})
    assert _checks(bare) == {
        "gradient_reduce ⊇ data_parallel": "dp",
        "gradient_reduce ⊇ context": "cp",
    }
    with_grad = [*kinds, layout_kind(layout, "dp_cp", "", "dp", "cp")]
    assert find_violations(_expected(with_grad, {"data_parallel": "dp", "context": "cp",
                                                 "gradient_reduce": "dp_cp"})) == []  # fmt: skip
    only_dp = [*kinds, layout_kind(layout, "grad", "", "dp")]
    split = _expected(only_dp, {"data_parallel": "dp", "context": "cp", "gradient_reduce": "grad"})
    assert _checks(split) == {"gradient_reduce ⊇ context": "cp"}
    unknown = Expected("test", 8, {}, kinds, {"data_parallel": "dp", "context": "cp"},
                       unknown_roles={"gradient_reduce": "cannot tell"})  # fmt: skip
    assert find_violations(unknown) == []


def test_single_rank_peers_need_no_gradient_group() -> None:
    layout = Layout(tp=8)
    kinds = [layout_kind(layout, "tp", "", "tp"), Kind("dp", "", Groups([(r,) for r in range(8)]))]
    assert find_violations(_expected(kinds, {"data_parallel": "dp", "tensor": "tp"})) == []
