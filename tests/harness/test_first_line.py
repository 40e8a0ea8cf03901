"""The first line of a failure carries the finding: pytest's short summary and a JUnit message
show nothing else. Before, it read "RankFailure: meshsim.run(...): 8 of 8 ranks failed", and on
the fake tier one wrong mesh gave 8 separate LayoutMismatch blocks (147 lines); a hang read
"timed out after 30 s; ranks 0-7 still running", the culprit left to eight stacks."""

from __future__ import annotations

import threading

import pytest

import meshsim
from meshsim import DataflowMismatch, RankFailure, RankTimeout
from meshsim.harness.pool import pool_pids
from tests.harness._lines import line_of

from .conftest import process_alive

EXPECTED = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
FINDING = (
    "LayoutMismatch: tp groups differ: expected [(0, 1, 2, 3), (4, 5, 6, 7)] observed "
    "[(0, 2, 4, 6), (1, 3, 5, 7)] on ranks 0-7"
)


def _wrong_order() -> None:
    """The classic mistake: mesh dims in the wrong order."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("tp", "dp"))
    meshsim.assert_layout(meshsim.observe(mesh), EXPECTED)


@pytest.mark.parametrize("backend", ["fake", "threaded", "gloo"])
def test_the_first_line_names_the_kind_expected_and_observed(backend: str) -> None:
    with pytest.raises(RankFailure) as caught:
        meshsim.run(_wrong_order, 8, backend=backend)
    first = str(caught.value).splitlines()[0]
    assert first.startswith(
        FINDING + f"; meshsim.run(_wrong_order, world_size=8, backend={backend!r})"
    )
    reported = [line for line in str(caught.value).splitlines() if ": LayoutMismatch: " in line]
    assert len(reported) == 1  # one block, however many ranks raised it


def test_the_fake_tiers_per_rank_mismatches_are_one_report() -> None:
    """Each fake rank can diff only its own groups; the report combines them as the gathering
    tiers do, with every rank in it."""
    with pytest.raises(RankFailure) as caught:
        meshsim.run(_wrong_order, 8, backend="fake")
    text = str(caught.value)
    assert text.splitlines()[1].startswith("ranks 0-7: LayoutMismatch: tp groups differ")
    assert "on 8 ranks against Expected('torch'" in text.splitlines()[1]
    assert "  tp: 8 ranks in the wrong group (ranks 0-7)" in text
    assert text.count("--- traceback of rank") == 1
    assert len(text.splitlines()) < 40


def test_a_dataflow_mismatch_leads_with_its_first_problem() -> None:
    problems = [
        "step 0: sampler split over dp_cp instead of dp: CP peers 0, 2 loaded different batches",
        "step 1: the same",
    ]
    first, second = str(DataflowMismatch(problems, what="the batches")).splitlines()[:2]
    assert first == problems[0]
    assert second == "the batches break the reference's roles (2 problems):"


def test_pytest_short_summary_shows_the_finding(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the summary line is cut at the terminal's width
    pytester.makepyfile(
        """
        import pytest
        import meshsim
        from torch.distributed.device_mesh import init_device_mesh

        @pytest.mark.meshsim(world_size=8, backend="fake")
        def test_mesh(rank):
            mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("tp", "dp"))
            expected = meshsim.expect("torch", 8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
            meshsim.assert_layout(meshsim.observe(mesh), expected)
        """
    )
    result = pytester.runpytest_subprocess("-rf", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED *test_mesh* - *LayoutMismatch: tp groups differ*"])


#: What rank 5 of ``_wait_for_a_sleeper`` waits on: set by the test once the run is over (a
#: threaded rank stuck in C code outlives the run; a gloo worker is killed first).
_RELEASE = threading.Event()


def _wait_for_a_sleeper() -> None:
    """The issue's hang: ranks 0, 2, 4, 6 all_gather with rank 5, ranks 1, 3, 7 all_reduce
    with it, and rank 5 never comes."""
    import torch
    import torch.distributed as dist

    evens = dist.new_group([0, 2, 4, 5, 6])
    odds = dist.new_group([1, 3, 5, 7])
    if dist.get_rank() == 5:
        _RELEASE.wait()
        return
    if dist.get_rank() % 2 == 0:
        dist.all_gather([torch.zeros(1) for _ in range(5)], torch.ones(1), group=evens)
    else:
        dist.all_reduce(torch.ones(1), group=odds)


@pytest.mark.parametrize(("backend", "timeout"), [("threaded", 10), ("gloo", 20)])
def test_a_hang_names_who_waits_for_whom(
    backend: str, timeout: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One first line on every tier: who waits in which call on which group, for whom, and the
    user's line where that rank is. The timeout only has to let the world come up (10 s / 20 s
    are far more than needed); rank 5 blocks until released, so the deadline ends the run."""
    from meshsim.harness import threaded

    monkeypatch.setattr(threaded, "JOIN_GRACE_S", 0.3)  # rank 5 cannot be stopped anyway
    _RELEASE.clear()
    try:
        with pytest.raises(RankTimeout) as caught:
            meshsim.run(_wait_for_a_sleeper, 8, backend=backend, timeout=timeout)
    finally:
        _RELEASE.set()  # the threaded rank 5 wakes and exits; nothing waits on it in gloo
    err = caught.value
    body = _wait_for_a_sleeper
    gather, reduce = line_of(body, "dist.all_gather("), line_of(body, "dist.all_reduce(")
    wait = line_of(body, "_RELEASE.wait()", source=True)
    assert err.finding == (
        f"ranks 0, 2, 4, 6 wait in all_gather on group (0,2,4,5,6) at {gather} for rank 5; "
        f"ranks 1, 3, 7 wait in all_reduce on group (1,3,5,7) at {reduce} for rank 5; "
        f"rank 5 is outside any collective at {wait}"
    )
    assert str(err).splitlines()[0] == (
        f"{err.finding}; meshsim.run(_wait_for_a_sleeper, world_size=8, backend={backend!r}) "
        f"timed out after {timeout} s; ranks 0-7 still running, all ranks stopped"
    )
    assert err.waits == {r: (5,) for r in range(8) if r != 5}
    assert err.collectives[0] == "all_gather on group (0,2,4,5,6) (call #3)"
    assert err.collectives[5] is None and isinstance(err, TimeoutError)
    # The stacks read alike on both tiers: most recent call last, with source, no internals.
    assert "dist.all_gather([torch.zeros(1)" in err.stacks[0]
    user_frames = [line.strip() for line in err.stacks[5].splitlines() if "File" in line]
    assert user_frames[0].endswith(", in _wait_for_a_sleeper")
    assert all("meshsim/harness" not in line for line in user_frames)
    assert err.survivors == ((5,) if backend == "threaded" else ())
    if backend == "gloo":  # every worker that ran a stopped rank was killed, not kept
        assert not [o.rank for o in err.outcomes if o.pid in pool_pids() or process_alive(o.pid)]
