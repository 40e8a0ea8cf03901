"""The ``meshsim`` command line: ``show``, ``diff``, ``verify`` and ``sweep``."""

from meshsim.cli.main import main

__all__ = ["main"]
