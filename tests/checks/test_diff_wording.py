"""How a diff reads, message by message: each test plants one bug in observed groups (or in a
builder) and pins the words that name it. Found by planting bugs in the frameworks' group code:
the diff blamed the right kind, but the words did not always help."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

import meshsim
from meshsim.checks import Observation, diff
from meshsim.checks.observation import GroupView
from meshsim.verify import verify
from tests.builders import _wrong

TP_2X2 = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))


def _view(name: str, members: tuple[int, ...], rank: int, **extra: Any) -> GroupView:
    return GroupView(name, members, members.index(rank) if rank in members else 0, **extra)


def _observed(
    groups: Mapping[int, Mapping[str, tuple[int, ...]]],
    extra: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Observation]:
    """One Observation per rank from ``{rank: {kind: members}}`` (``extra``: view fields)."""
    extra = extra or {}
    return [
        Observation(
            rank,
            len(groups),
            "fake",
            {
                name: _view(name, members, rank, **extra.get(rank, {}))
                for name, members in g.items()
            },
        )
        for rank, g in groups.items()
    ]


def test_a_group_built_where_the_framework_refuses_reads_as_a_refusal_expected() -> None:
    expected = meshsim.expect("olmo-core", 4)  # plain FSDP: OLMo-core has no tp sub-mesh
    found = diff(_observed({r: {"get_tp_mesh": (r - r % 2, r - r % 2 + 1)} for r in range(4)}),
                 expected)  # fmt: skip
    assert found is not None
    head = found.finding()
    assert head.startswith(
        "get_tp_mesh groups differ: expected no group (the reference says olmo-core refuses "
        "get_tp_mesh: RuntimeError: could not determine tensor parallel sub-mesh"
    ), head
    assert head.endswith("observed [(0, 1), (2, 3)] on ranks 0-3"), head
    assert "ranks 0, 1 hold (0, 1); expected none, the reference says olmo-core refuses" in str(
        found
    )
    assert "although the framework raises" not in str(found) and "but olmo-core" not in str(found)


def test_the_headline_leads_with_wrong_groups_not_a_symptom_of_an_earlier_kind() -> None:
    right = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    groups = {r: {"dp": right[r], "tp": (0, 1, 2, 3)} for r in range(4)}
    observed = _observed(groups)
    # dp (checked first) holds the right groups with wrong local ranks: a symptom only
    observed = [
        Observation(o.rank, 4, "fake", {**o.groups, "dp": GroupView("dp", right[o.rank], 1)})
        for o in observed
    ]
    found = diff(observed, TP_2X2)
    assert found is not None and found.kinds() == ["dp", "tp"]
    assert found.finding() == (
        "tp groups differ: expected [(0, 1), (2, 3)] observed [(0, 1, 2, 3)] on ranks 0-3"
    )


def test_ranks_whose_group_their_peers_dispute_are_counted_among_the_wrong() -> None:
    """Ranks 0 and 1 hold a wrong group that peers dispute (a disagreement); 2-7 hold wrong
    groups outright: all 8 are in the wrong group."""
    expected = meshsim.expect("torch", 8, mesh_shape=(4, 2), mesh_dim_names=("dp", "tp"))
    groups = {r: {"tp": (r % 4, r % 4 + 4)} for r in range(8)}
    groups[0] = {"tp": (0, 2)}
    groups[1] = {"tp": (1, 3)}
    extra = {r: {"disagreement": f"ranks {r} and {r + 2} disagree on tp"} for r in (0, 1)}
    found = diff(_observed(groups, extra), expected)
    assert found is not None
    summary = found.kind_summary("tp")
    assert summary.startswith("tp: 8 ranks in the wrong group (ranks 0-7)"), summary
    assert found.finding().endswith("on ranks 0-7"), found.finding()


def test_ranks_with_no_group_are_named_in_one_sentence() -> None:
    groups: dict[int, dict[str, tuple[int, ...]]] = {0: {"tp": (0, 2)}, 2: {"tp": (0, 2)}}
    observed = _observed(groups) + [Observation(r, 4, "fake", {}) for r in (1, 3)]
    found = diff(observed, TP_2X2, kinds=["tp"])
    assert found is not None
    assert found.finding() == (
        "tp groups differ: expected [(0, 1), (2, 3)] observed [(0, 2)] (no group on ranks 1, 3) "
        "on ranks 0-3"
    )
    assert "and no group on some ranks" not in str(found)


def test_a_torch_refusal_inside_a_frameworks_group_call_names_the_call_and_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A planted bug: the framework's group code asks for ``new_group([])``; torch's pybind
    constructor error (several lines of overloads) becomes the call, the ranks and one line."""
    import meshsim.verify as verify_module

    def empty_group(world: int, cfg: Mapping[str, Any]) -> Any:
        import torch.distributed as dist

        dist.new_group([])

    monkeypatch.setattr(
        verify_module, "BUILDERS", {f: "tests.builders._wrong" for f in meshsim.CONVENTIONS}
    )
    monkeypatch.setattr(_wrong, "BEHAVIOUR", empty_group)
    result = verify("torch", 4, "threaded", mesh_shape=(4,), mesh_dim_names=("dp",))
    assert not result.passed
    error = result.error or ""
    call = "in new_group for group () on ranks 0-3: "
    # The released torch decides which refusal comes first: 2.13 raises the pybind
    # constructor's TypeError (several lines of overloads, which must become one);
    # 2.15 asserts on the missing group rank before it constructs anything.
    assert error.startswith(
        (
            f"the builder raised TypeError {call}torch could not construct the ProcessGroup "
            "(invoked with store, None, 0)",
            f"the builder raised AssertionError {call}Group rank must be specified",
        )
    ), error
    assert "\n" not in error and "supported" not in error
