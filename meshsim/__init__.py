"""meshsim: prove parallel-training rank layouts right, on a laptop and in CI."""

from meshsim.errors import LayoutError, MeshsimError, UsageError
from meshsim.model import (
    CONVENTIONS,
    ROLES,
    Expected,
    Groups,
    Kind,
    Layout,
    LayoutCase,
    expect,
    layouts,
)

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS",
    "ROLES",
    "Expected",
    "Groups",
    "Kind",
    "Layout",
    "LayoutCase",
    "LayoutError",
    "MeshsimError",
    "UsageError",
    "expect",
    "layouts",
]
