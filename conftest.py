"""Root conftest: pytester for the plugin's own tests (meshsim loads via its entry point)."""

import contextlib

pytest_plugins = ["pytester"]

# pytester snapshots sys.modules around each test and drops what the test imported. A torch
# first imported inside such a test (a body run in-process by the plugin's own tests) would be
# dropped and imported again by a later test, which torch does not survive ("function
# '_has_torch_function' already has a docstring"). Importing it here keeps the suite's verdicts
# independent of test order.
with contextlib.suppress(ImportError):  # every test that needs torch skips without it
    import torch  # noqa: F401

try:  # hypothesis is a test extra; without it the property tests skip themselves
    from hypothesis import settings
except ImportError:  # pragma: no cover
    pass
else:
    # No per-example deadline: on a loaded CI machine a slow example is not a failure, and a
    # verdict must never depend on timing.
    settings.register_profile("meshsim", deadline=None)
    settings.load_profile("meshsim")


def pytest_runtest_setup(item):  # type: ignore[no-untyped-def]
    """A ``requires_framework(name)`` test skips on a release of the framework other than the
    one meshsim's adapter is tested with (a GPU image's transformers 5.17 lacks what the 5.23
    adapter reads): its verdict there would be about the release, not about meshsim."""
    for marker in item.iter_markers("requires_framework"):
        from meshsim.builders.real import untested_version

        note = untested_version(marker.args[0])
        if note is not None:
            import pytest

            pytest.skip(note)
