"""DeepSpeed's ``p2p`` pairs are checked like any kind: a reversed pipeline neighbour is a diff.

``grid.p2p_groups`` is a list of ``[rank, next stage]`` pairs, not process groups; each rank
hands :func:`meshsim.observe_groups` the pair it leads. The planted bug sends to the previous
stage instead of the next, in a small rank body beside correct pipe and data groups.
"""

from __future__ import annotations

import pytest

import meshsim
from meshsim.checks import diff, observe_groups

CONFIG = {"num_pp": 4, "num_dp": 2}  # world 8: pipe groups (0, 2, 4, 6) and (1, 3, 5, 7)


def _grid(reverse: bool) -> meshsim.Observation:
    import torch.distributed as dist

    me = dist.get_rank()
    pipes = [[0, 2, 4, 6], [1, 3, 5, 7]]
    datas = [[2 * s, 2 * s + 1] for s in range(4)]
    held = {}
    for kind, families in (("pipe", pipes), ("data", datas)):
        for ranks in families:
            group = dist.new_group(ranks)
            if me in ranks:
                held[kind] = group
    stages = next(p for p in pipes if me in p)
    step = -1 if reverse else 1
    neighbour = stages[(stages.index(me) + step) % len(stages)]
    return observe_groups({**held, "p2p": [me, neighbour]})


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_reversed_pipeline_neighbour_is_a_diff_naming_p2p(backend: str) -> None:
    expected = meshsim.expect("deepspeed", 8, **CONFIG)
    right = meshsim.run(_grid, 8, backend=backend, timeout=120, args=(False,))
    assert diff(right, expected) is None
    wrong = meshsim.run(_grid, 8, backend=backend, timeout=120, args=(True,))
    found = diff(wrong, expected)
    assert found is not None and found.kinds() == ["p2p"]
    text = str(found)
    assert "p2p: 8 ranks in the wrong group" in text
    assert "rank 0 holds (0, 6); expected (0, 2)" in text


def test_a_pair_is_recorded_not_proven() -> None:
    """No collective runs over a pair (its members each lead a different one)."""
    observations = meshsim.run(_grid, 8, backend="gloo", timeout=120, args=(False,))
    pair = observations[2].groups["p2p"]
    assert pair.members == (2, 4) and pair.local_rank == 0
    assert pair.gathered is None and pair.backends is None and pair.disagreement is None
