"""Which torch release the reference describes, and what that release lacks.

The ``torch`` and ``torchtitan`` conventions model calls that only exist from some release on
(``DeviceMesh._unflatten``: torch 2.10). The reference follows the torch that is installed,
read from its package metadata (torch itself is not imported), so on torch 2.9 it says what
2.9 does: ``_unflatten`` raises ``AttributeError``, and ``verify`` agrees with the live run.
Without torch installed it describes the newest release. ``MESHSIM_TORCH_RELEASE`` pins the
release described (``2.9``, or ``newest``): meshsim's own model tests pin ``newest``.
"""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata

from meshsim.errors import LayoutError

#: The first release with ``DeviceMesh._unflatten``.
UNFLATTEN_SINCE = (2, 10)
#: Releases whose ``_unflatten`` refuses every dim given by name (an inverted membership test:
#: ``ValueError: dim world specified in `_unflatten` is not in ('world',)``).
UNFLATTEN_BY_NAME_BROKEN = frozenset({(2, 10), (2, 11)})


@functools.cache
def installed() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed torch, or None when there is none."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def target() -> tuple[int, int] | None:
    """The release the reference describes; None for the newest."""
    return _target(os.environ.get("MESHSIM_TORCH_RELEASE", ""))


@functools.lru_cache(maxsize=16)
def _target(setting: str) -> tuple[int, int] | None:
    pinned = setting.strip()
    if pinned == "newest":
        return None
    if pinned:
        found = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)?", pinned)
        if found is None:
            raise LayoutError(f"MESHSIM_TORCH_RELEASE={pinned!r}: expected e.g. 2.9 or newest")
        return int(found[1]), int(found[2])
    return installed()


#: The first release whose ``init_device_mesh`` takes ``backend_override`` (2.6: absent,
#: 2.9: present; 2.8 added it).
BACKEND_OVERRIDE_SINCE = (2, 8)


def _before(release: tuple[int, int]) -> bool:
    described = target()
    return described is not None and described < release


def flatten_name_taken_error() -> str:
    """What ``_flatten`` into a root dim's name raises: RuntimeError before 2.10."""
    return "RuntimeError" if _before((2, 10)) else "ValueError"


def empty_mesh_error() -> str:
    """What ``init_device_mesh`` with a leading dim of size 0 (verl's ``(0, sp)``) raises:
    before 2.10 a RuntimeError from reshaping the empty rank tensor, since then its own
    AssertionError."""
    return "RuntimeError" if _before((2, 10)) else "AssertionError"


def negative_mesh_dim_error() -> str:
    """What ``init_device_mesh`` raises for negative dim sizes whose product is the world
    (``(-2, -4)`` on 8 ranks): 2.10 to 2.12 lay the rank map out through CuTe's
    ``complement``, which asserts; before and since, reshaping the rank tensor raises a
    RuntimeError. Measured on 2.9.1, 2.10.0, 2.13.0 and 2.15.0; 2.11 and 2.12 read from their
    source (the same ``complement`` path as 2.10)."""
    described = target()
    between = described is not None and (2, 10) <= described < (2, 13)
    return "AssertionError" if between else "RuntimeError"


def backend_options_error() -> str:
    """What ``backend_override`` with a non-Options second item raises: TypeError before 2.10."""
    return "TypeError" if _before((2, 10)) else "AttributeError"


def require_backend_override() -> None:
    """Raise what ``init_device_mesh(..., backend_override=...)`` raises before 2.8."""
    if _before(BACKEND_OVERRIDE_SINCE):
        release = target()
        raise LayoutError(
            f"init_device_mesh() got an unexpected keyword argument 'backend_override' "
            f"(torch {release[0]}.{release[1]} has none; it first appears in torch 2.8)",  # type: ignore[index]
            upstream="TypeError",
        )


def require_flatten_of_flattened(what: str) -> None:
    """Raise what ``_flatten`` of a view holding a flattened dim raises before torch 2.10.

    Releases before 2.10 look every dim of the flattened view up among the root's own dims
    (``root.mesh_dim_names.index(name)``), so a flattened name is not found.
    """
    if _before((2, 10)):
        raise LayoutError(
            f"{what}: tuple.index(x): x not in tuple (torch before 2.10 flattens root dims "
            f"only, not a dim that is itself flattened)",
            upstream="ValueError",
        )


def slice_order_rule() -> str:
    """How ``DeviceMesh.__getitem__`` checks the order of the sliced dims.

    ``"collapsed"`` (torch >= 2.13): the sliced layout, collapsed (size-1 dims dropped), must be
    sorted. ``"strides"`` (2.10-2.12): each dim's stride, size-1 dims included, must not grow,
    and a flattened dim must be one contiguous mode (else NotImplementedError). ``"indices"``
    (before 2.10): root dim indices must ascend.
    """
    return _slice_order_rule(os.environ.get("MESHSIM_TORCH_RELEASE", ""))


@functools.lru_cache(maxsize=16)
def _slice_order_rule(setting: str) -> str:
    described = _target(setting)  # read once per setting: every slice of a sweep asks
    if described is not None and described < (2, 10):
        return "indices"
    if described is not None and described < (2, 13):
        return "strides"
    return "collapsed"


def require_unflatten_by_name(dim: object, names: tuple[str, ...]) -> None:
    """Raise what torch 2.10 raises for ``_unflatten`` of a dim given by name."""
    if isinstance(dim, str) and target() in UNFLATTEN_BY_NAME_BROKEN:
        raise LayoutError(
            f"dim {dim} specified in `_unflatten` is not in {names} (torch 2.10 and 2.11 "
            f"refuse every dim given by name; pass its index)",
            upstream="ValueError",
        )


def builds_unflatten() -> bool:
    """The described release has ``DeviceMesh._unflatten``."""
    return not _before(UNFLATTEN_SINCE)


def require_unflatten(what: str) -> None:
    """Raise what the described torch raises for ``what`` when it has no ``_unflatten``."""
    release = target()
    if release is not None and release < UNFLATTEN_SINCE:
        raise LayoutError(
            f"{what}: torch {release[0]}.{release[1]} has no DeviceMesh._unflatten "
            f"(it first appears in torch {UNFLATTEN_SINCE[0]}.{UNFLATTEN_SINCE[1]})",
            upstream="AttributeError",
        )
