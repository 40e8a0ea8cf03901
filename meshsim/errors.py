"""Every exception meshsim raises, each subclassing the builtin it means."""

from __future__ import annotations


class MeshsimError(Exception):
    """Base class of all meshsim errors."""


class LayoutError(MeshsimError, ValueError):
    """An invalid layout or config: degrees, axis names, slicing or flattening rules.

    ``upstream`` names the exception type the real framework raises for the same mistake
    (``"KeyError"``, ``"RuntimeError"``, ``"AssertionError"``, ...), so live checks can
    compare meshsim's verdict with the framework's.
    """

    def __init__(self, message: str, *, upstream: str | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream


class UsageError(MeshsimError, ValueError):
    """Bad arguments to a meshsim API (world size, backend name, timeout, ...)."""


class LayoutMismatch(MeshsimError, AssertionError):
    """Live groups differ from the reference; ``diff`` holds every mismatch, compactly."""

    def __init__(self, diff: object) -> None:
        super().__init__(str(diff))
        self.diff = diff
