"""The ``meshsim`` command line: ``show``, ``diff``, ``verify``, ``sweep`` and ``list``."""

from meshsim.cli.main import main

__all__ = ["main"]
