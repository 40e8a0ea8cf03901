"""Root conftest: pytester for the plugin's own tests (meshsim loads via its entry point)."""

pytest_plugins = ["pytester"]
