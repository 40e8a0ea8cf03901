"""The pytest plugin, end to end: pytester writes test files and runs pytest on them."""

from __future__ import annotations

import pytest

import meshsim

# Every run is a subprocess: torch cannot be re-imported in one process, and pytester's
# in-process runs drop the modules first imported inside them.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_marker_parametrizes_and_runs_body_on_every_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.meshsim(world_size=[2, 4], backend=["threaded", "fake"])
        def test_ranks(rank, world_size, backend, tmp_path):
            assert dist.get_rank() == rank
            assert dist.get_world_size() == world_size
            assert str(dist.get_backend()) == backend
            assert tmp_path.exists()
        """
    )
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*test_ranks?threaded-2? PASSED*",
            "*test_ranks?threaded-4? PASSED*",
            "*test_ranks?fake-4? PASSED*",
        ]
    )


def test_rank_failures_are_reported_per_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.meshsim(world_size=4, backend="threaded")
        def test_two_ranks_fail(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert rank < 2, f"rank {rank} disagrees"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*RankFailure*of 4 ranks failed*", "*rank [23]: AssertionError: rank [23] disagrees*"]
    )


def test_skip_on_every_rank_skips_the_item(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim(world_size=2, backend="threaded")
        def test_skips(rank):
            pytest.skip("not on this layout")
        """
    )
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*ranks 0, 1: not on this layout*"])


def test_timeout_reports_stacks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist

        # 30 s: long enough for a gloo world to come up on a loaded machine, so rank 0 is
        # surely inside its all_reduce when the deadline comes.
        @pytest.mark.meshsim(world_size=2, backend="gloo", timeout=30)
        def test_hangs(rank):
            import time

            if rank == 0:
                dist.all_reduce(torch.ones(1))
            while True:  # rank 1 is slow, not diverged: a timeout, not a divergence
                time.sleep(0.01)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*RankTimeout*timed out after 30 s*",
            "*rank 0: blocked in all_reduce*",
            "*rank 1: not in a collective*",
            "*stack of rank 0*",
        ]
    )
    assert "During handling" not in result.stdout.str()


def test_nccl_items_skip_without_gpus_and_options_override(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim(world_size=2, backend="nccl")
        def test_gpu(rank):
            pass

        @pytest.mark.meshsim(world_size=[2, 16], backend="threaded")
        def test_sizes(rank, backend):
            assert backend == "fake"
        """
    )
    result = pytester.runpytest_subprocess(
        "-rs", "-p", "no:cacheprovider", "--meshsim-max-world-size=8", "-k", "test_sizes"
    )
    result.assert_outcomes(skipped=1, failed=1)  # threaded-2 fails its own assert; 16 is skipped
    result = pytester.runpytest_subprocess(
        "-rs", "-p", "no:cacheprovider", "--meshsim-backend=fake", "--meshsim-max-world-size=8"
    )
    result.stdout.fnmatch_lines(["*world size 16 > --meshsim-max-world-size 8*"])
    result.assert_outcomes(passed=2, skipped=1)
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus < 2:
        result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider", "-k", "test_gpu")
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["*GPU*"])


def test_bad_marker_and_option_usage(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim(worldsize=2)
        def test_typo(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*unknown keywords ?'worldsize'?*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--meshsim-backend=mpi")
    result.stderr.fnmatch_lines(
        ["*'mpi' is not a backend; choose from fake, threaded, gloo, nccl*"]
    )


def test_rank_fixture_outside_meshsim_tests_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_plain(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*only exists in @pytest.mark.meshsim tests*"])


def test_downstream_layout_fixtures_and_live_check(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import meshsim
        from meshsim.fixtures import parametrize_layouts
        from torch.distributed.device_mesh import init_device_mesh

        @parametrize_layouts(4, "torch")
        def test_reference_invariants(layout_case, meshsim_expected):
            from meshsim.model.invariants import find_violations
            assert meshsim_expected.world_size == 4
            assert find_violations(meshsim_expected) == []

        @pytest.mark.meshsim(world_size=4, backend="gloo")
        @pytest.mark.meshsim_layout("torch", mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
        def test_live_mesh(rank, meshsim_expected):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            meshsim.assert_layout(meshsim.observe(mesh), meshsim_expected)
        """
    )
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    # one item per world-4 torch layout the sweep lists, plus the live test
    result.assert_outcomes(passed=len(meshsim.layouts(4, "torch")) + 1)
    result.stdout.fnmatch_lines(
        ["*test_reference_invariants?torch-4-shape=1,1,4,1*", "*test_live_mesh?gloo-4? PASSED*"]
    )


def test_downstream_refusal_items_carry_the_frameworks_type(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from meshsim.fixtures import parametrize_refusals
        from torch.distributed.device_mesh import init_device_mesh

        @parametrize_refusals(4, "torch")
        def test_torch_refuses(refused_case):
            upstream = refused_case.error().upstream
            assert upstream in ("RuntimeError", "KeyError", "ValueError")
            config = refused_case.config
            if list(config) == ["mesh_shape"]:  # the one init_device_mesh alone can show
                import torch.distributed as dist
                from torch.testing._internal.distributed.fake_pg import FakeStore

                dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
                try:
                    with pytest.raises(RuntimeError, match="bigger than default world size"):
                        init_device_mesh("cpu", config["mesh_shape"])
                finally:
                    dist.destroy_process_group()
        """
    )
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    from meshsim import refused_configs

    result.assert_outcomes(passed=len(refused_configs(4, "torch")))
    result.stdout.fnmatch_lines(["*test_torch_refuses?torch-4-shape=2,4? PASSED*"])


def test_assertrepr_explains_layout_diff(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import meshsim
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        def test_compare():
            def body():
                ranks = torch.arange(4).reshape(2, 2).T.contiguous()
                mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"))
                return meshsim.observe(mesh)
            observed = meshsim.ObservedLayout.of(meshsim.run(body, 4, backend="fake"))
            expected = meshsim.expect("torch", 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
            assert observed == expected
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*observed layout differs from the reference*",
            "*tp: 4 ranks in the wrong group*expected [[]*(0, 1), (2, 3)*"
            "[]]; observed [[]*(0, 2), (1, 3)*",
        ]
    )
