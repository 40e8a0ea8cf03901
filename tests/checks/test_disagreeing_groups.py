"""Ranks that disagree about a group: a diff naming the kind and both claims, never a hang.

The bug planted here is the classic per-rank rank formula: every rank creates the same groups
(so creation itself is fine), then picks its "tp" group by a formula that differs by rank.
Rank 0 holds (0, 2), rank 2 holds (2, 3): an all-gather over "tp" would never complete, as rank
0 waits in one group and rank 2 in another.
"""

from __future__ import annotations

import pytest

import meshsim
from meshsim.checks import diff, observe_groups

CANDIDATES = [(0, 2), (1, 3), (0, 1), (2, 3)]
#: rank -> index into CANDIDATES of the group the buggy formula hands it
PICKED = {0: 0, 1: 1, 2: 3, 3: 1}


def _inconsistent_tp() -> meshsim.Observation:
    import torch.distributed as dist

    groups = [dist.new_group(list(ranks)) for ranks in CANDIDATES]  # same calls on every rank
    return observe_groups({"tp": groups[PICKED[dist.get_rank()]]})


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_ranks_disagreeing_on_a_group_are_a_diff_not_a_hang(backend: str) -> None:
    observations = meshsim.run(_inconsistent_tp, 4, backend=backend, timeout=120)
    said = observations[0].groups["tp"].disagreement
    assert said == "ranks 0 and 2 disagree on tp: rank 0 says (0, 2), rank 2 says (2, 3)"
    assert observations[0].groups["tp"].gathered is None  # not proven: it could not complete
    expected = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    found = diff(list(observations), expected, ("tp",))
    assert found is not None
    text = str(found)
    assert "tp" in text and "ranks 0 and 2 disagree on tp" in text


def _consistent_tp() -> meshsim.Observation:
    import torch.distributed as dist

    groups = [dist.new_group(list(ranks)) for ranks in CANDIDATES]
    rank = dist.get_rank()
    return observe_groups({"tp": groups[2 if rank < 2 else 3]})


def test_groups_every_member_agrees_on_are_still_proven() -> None:
    observations = meshsim.run(_consistent_tp, 4, backend="threaded", timeout=120)
    for obs in observations:
        view = obs.groups["tp"]
        assert view.disagreement is None and view.gathered == view.members
