"""The meshsim_serial fixture: assert_matches_serial bound to the test's layout marker."""

from __future__ import annotations

import functools

import pytest

from meshsim.errors import SerialMismatch
from tests.usage import toy

DENSE = {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp", "cp", "tp")}


@pytest.mark.meshsim_layout("torch", world_size=8, **DENSE)
def test_the_fixture_passes_a_correct_step(meshsim_serial) -> None:  # type: ignore[no-untyped-def]
    result = meshsim_serial(toy.dense_step, batch=toy.dense_batch)
    assert result.world_size == 8 and result.backend == "threaded"
    assert result.comparison.passed and result.comparison.compared > 0


@pytest.mark.meshsim_layout("torch", world_size=8, **DENSE)
def test_the_fixture_fails_a_planted_bug_on_gloo(meshsim_serial) -> None:  # type: ignore[no-untyped-def]
    step = functools.partial(toy.dense_step, bug="norm_grad_not_reduced_over_tp")
    with pytest.raises(SerialMismatch, match=r"^grad of `norm1.weight` at step 1 on ranks 0-7"):
        meshsim_serial(step, batch=toy.dense_batch, backend="gloo")


def test_the_fixture_without_a_world_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.meshsim_layout("torch", mesh_shape=(2,), mesh_dim_names=("dp",))
        def test_x(meshsim_serial):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        ["*meshsim_serial needs @pytest.mark.meshsim_layout(framework, world_size=N*"]
    )
    assert result.ret != 0
