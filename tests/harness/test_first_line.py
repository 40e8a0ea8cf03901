"""The first line of a failure carries the finding: pytest's short summary and a JUnit message
show nothing else. Before, it read "RankFailure: meshsim.run(...): 8 of 8 ranks failed", and on
the fake tier one wrong mesh gave 8 separate LayoutMismatch blocks (147 lines)."""

from __future__ import annotations

import pytest

import meshsim
from meshsim import DataflowMismatch, RankFailure

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
