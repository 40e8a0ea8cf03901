"""Root conftest: makes the repository importable as ``tests.*`` and registers the plugin in-tree."""
