"""``sweep --gpus-per-node G [--within-node K,K]``: which kinds of each layout cross nodes, and
only the layouts whose named kinds stay inside one, checked against
``meshsim.assert_within_nodes`` on the same reference layouts."""

from __future__ import annotations

import json

import pytest

import meshsim
from meshsim.cli.placement import Question, parse_within, place, validate_within
from meshsim.errors import GroupsCrossNodes, UsageError
from meshsim.model.sweep import layouts
from tests.cli.helpers import assert_bad_input, run_cli
from tests.cli.json_schema import errors
from tests.cli.test_json_schemas import schema


def _inside(expected: meshsim.Expected, name: str, gpus_per_node: int) -> bool:
    """No group of the role ``name`` spans nodes (a layout without the role has none)."""
    if name not in expected.roles:
        return True
    try:
        meshsim.assert_within_nodes(expected, name, gpus_per_node)
    except GroupsCrossNodes:
        return False
    return True


def test_tensor_groups_of_four_cross_nodes_of_two_not_of_four() -> None:
    expected = meshsim.expect("megatron", 16, tensor_model_parallel_size=4)  # tp (0,1,2,3), ...
    on_two = place(expected, Question(2, ("tensor", "tp")))
    assert "tp" in on_two.crossing and "tensor" in on_two.roles
    assert on_two.named == {"tensor": "tp", "tp": "tp"}
    assert not on_two.kept and on_two.crossing_named() == ["tensor", "tp"]
    on_four = place(expected, Question(4, ("tensor",)))
    assert "tp" not in on_four.crossing and on_four.kept
    assert "dp" in on_four.crossing  # dp groups (0,4,8,12) span the four nodes


def test_a_name_the_layout_lacks_cannot_cross_and_a_refused_layout_crosses_nothing() -> None:
    expected = meshsim.expect("deepspeed", 8, num_mp=2)  # no expert role in deepspeed
    placed = place(expected, Question(1, ("expert", "tensor")))
    assert placed.named == {"expert": None, "tensor": "model"}
    assert placed.crossing_named() == ["tensor"] and not placed.kept
    nothing = place(None, Question(1, ("tensor",)))
    assert nothing.crossing == () and nothing.kept


@pytest.mark.parametrize(
    ("world", "framework", "name"), [(4, "megatron", "tensor"), (8, "deepspeed", "pipeline")]
)
def test_kept_is_exactly_what_assert_within_nodes_accepts(
    world: int, framework: str, name: str
) -> None:
    answers = {True: 0, False: 0}
    for case in layouts(world, framework):
        expected = case.expect()
        placed = place(expected, Question(2, (name,)))
        assert placed.kept == _inside(expected, name, 2), case.id
        answers[placed.kept] += 1
    assert answers[True] and answers[False]  # both answers occur: the check compares something


def test_within_node_names_are_parsed_once_each_and_checked() -> None:
    assert parse_within(["tp,ep", " tensor ", "tp"]) == ("tp", "ep", "tensor")
    megatron, deepspeed = layouts(8, "megatron"), layouts(8, "deepspeed")
    validate_within(["tensor", "tp", "expert"], megatron)  # a role, kinds of megatron
    validate_within(["model"], deepspeed)
    with pytest.raises(UsageError, match=r"'tp' is neither a role nor a kind of deepspeed") as info:
        validate_within(["tp"], deepspeed)
    assert "tensor" in str(info.value) and "model" in str(info.value)  # roles and kinds named


def test_sweep_verifies_only_the_layouts_that_keep_tensor_inside_a_node() -> None:
    result = run_cli(
        *("sweep", "-n", "8", "--framework", "deepspeed", "--jobs", "1", "--json"),
        *("--gpus-per-node", "2", "--within-node", "tensor"),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert errors(data, schema("sweep")) == []
    cases = {c.id: c for c in layouts(8, "deepspeed")}
    inside = {i for i, c in cases.items() if _inside(c.expect(), "tensor", 2)}
    assert {r["id"] for r in data["results"]} == inside
    placement = data["placement"]
    assert placement["within_node"] == ["tensor"] and placement["gpus_per_node"] == 2
    assert placement["layouts_kept"] == len(inside) == data["passed"]
    assert placement["layouts_left_out"] == len(cases) - len(inside) > 0
    assert data["layouts_done"] == data["layouts_total"] == len(cases) and data["complete"]
    for r in data["results"]:
        assert "model" not in r["crosses_nodes"] and "tensor" not in r["roles_crossing_nodes"]
    assert placement["by_framework"][0]["crossing"] == {"tensor": len(cases) - len(inside)}
    summary = f"nodes of 2 GPUs: {len(inside)} of {len(cases)} layouts examined keep tensor"
    assert summary in result.stderr


def test_within_node_needs_gpus_per_node_and_known_names() -> None:
    alone = run_cli("sweep", "-n", "4", "--within-node", "tensor")
    assert_bad_input(alone, "--within-node needs --gpus-per-node")
    line = assert_bad_input(
        run_cli(
            *("sweep", "-n", "4", "--framework", "torch", "--gpus-per-node", "2"),
            *("--within-node", "tensor,tnesor"),
        ),
        "'tnesor' is neither a role nor a kind of torch",
    )
    assert "data_parallel" in line and "meshsim list F" in line
