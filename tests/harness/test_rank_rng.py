"""Each rank draws random numbers as a process of its own would, on every tier.

A real job's ranks are processes: ``torch.manual_seed(0)`` then an ``nn.Linear`` gives every
rank the same weights, a rank that never seeds starts at torch's fixed start seed (so the same
weights again), and a rank's seed touches that rank alone. Threaded ranks share one process and
once shared one generator: after ``manual_seed(0)`` 8 ranks held 2 distinct models.
"""

from __future__ import annotations

import pytest
import torch

import meshsim

TIERS = ["fake", "threaded", "gloo"]


def _seeded_linear() -> float:
    torch.manual_seed(0)
    return float(torch.nn.Linear(16, 16).weight.detach().sum())


def _unseeded_linear() -> float:
    return float(torch.nn.Linear(16, 16).weight.detach().sum())


@pytest.mark.parametrize("backend", TIERS)
def test_the_same_seed_gives_every_rank_the_same_model(backend: str) -> None:
    weights = meshsim.run(_seeded_linear, 8, backend=backend)
    assert len(set(weights)) == 1
    torch.manual_seed(0)
    assert weights[0] == float(torch.nn.Linear(16, 16).weight.detach().sum())  # as one process gets


@pytest.mark.parametrize("backend", TIERS)
def test_unseeded_ranks_start_at_torchs_start_seed(backend: str) -> None:
    """Before every run, on every tier (a warm gloo worker too): the first job's draws do not
    shift the second's."""
    first = meshsim.run(_unseeded_linear, 4, backend=backend)
    second = meshsim.run(_unseeded_linear, 4, backend=backend)
    assert len(set(first)) == 1 and first == second
    fresh = torch.Generator()  # a generator that never seeded: torch's start seed
    bound = 1 / 16**0.5  # nn.Linear's kaiming-uniform bound for 16 inputs
    weight = torch.empty(16, 16).uniform_(-bound, bound, generator=fresh)
    assert first[0] == pytest.approx(float(weight.sum()), abs=1e-4)


def _per_rank_seeds() -> tuple[float, float, float]:
    import random

    import numpy
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(rank)
    random.seed(rank)
    numpy.random.seed(rank)
    return float(torch.rand(1)), random.random(), float(numpy.random.rand())


@pytest.mark.parametrize("backend", TIERS)
def test_a_ranks_seed_is_its_own(backend: str) -> None:
    """torch, random and numpy seeded per rank: each rank's draws as a process with that seed."""
    import random

    import numpy

    draws = meshsim.run(_per_rank_seeds, 4, backend=backend)
    for rank, (t, r, n) in enumerate(draws):
        assert t == float(torch.rand(1, generator=torch.Generator().manual_seed(rank)))
        assert r == random.Random(rank).random()
        assert n == float(numpy.random.RandomState(rank).rand())


@pytest.mark.parametrize("backend", ["fake", "threaded"])
def test_the_callers_generators_are_untouched(backend: str) -> None:
    import random

    import numpy

    torch.manual_seed(123)
    random.seed(123)
    numpy.random.seed(123)
    meshsim.run(_per_rank_seeds, 4, backend=backend)
    assert float(torch.rand(1)) == float(
        torch.rand(1, generator=torch.Generator().manual_seed(123))
    )
    assert random.random() == random.Random(123).random()
    assert float(numpy.random.rand()) == float(numpy.random.RandomState(123).rand())


def _interleaved_draws() -> list[float]:
    """Ranks seed alike, then draw while the others draw (a collective between draws)."""
    import torch.distributed as dist

    torch.manual_seed(7)
    out = []
    for _ in range(20):
        out.append(float(torch.randn(1)))
        dist.barrier()
    return out


def test_threaded_ranks_drawing_at_once_keep_their_own_streams() -> None:
    streams = meshsim.run(_interleaved_draws, 4, backend="threaded")
    generator = torch.Generator().manual_seed(7)
    alone = [float(torch.randn(1, generator=generator)) for _ in range(20)]
    assert all(stream == alone for stream in streams)
