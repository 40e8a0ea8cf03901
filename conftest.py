"""Root conftest: pytester for the plugin's own tests (meshsim loads via its entry point)."""

pytest_plugins = ["pytester"]

try:  # hypothesis is a test extra; without it the property tests skip themselves
    from hypothesis import settings
except ImportError:  # pragma: no cover
    pass
else:
    # No per-example deadline: on a loaded CI machine a slow example is not a failure, and a
    # verdict must never depend on timing.
    settings.register_profile("meshsim", deadline=None)
    settings.load_profile("meshsim")
