"""Markers for tests of a feature some torch releases lack: they skip there, naming the release."""

from __future__ import annotations

import pytest

from meshsim.model import torch_release

_RELEASE = torch_release.installed()
_FOUND = "no torch" if _RELEASE is None else f"torch {_RELEASE[0]}.{_RELEASE[1]}"


def _before(release: tuple[int, int]) -> bool:
    return _RELEASE is not None and release > _RELEASE


#: torchtitan's current/intermediate ``build_mesh`` (and anything unflattening a DeviceMesh).
needs_unflatten = pytest.mark.skipif(
    _before(torch_release.UNFLATTEN_SINCE),
    reason=f"{_FOUND} has no DeviceMesh._unflatten (torch >= 2.10), which torchtitan's "
    "current build_mesh calls",
)

#: The fake tier's fast path replaces ``DeviceMesh._init_one_process_group`` (torch >= 2.10).
needs_mesh_layout = pytest.mark.skipif(
    _before((2, 10)),
    reason=f"{_FOUND}'s DeviceMesh has no _init_one_process_group/_MeshLayout (torch >= 2.10); "
    "the fake tier runs torch's own group creation there",
)

#: ``_flatten`` of a view holding a flattened dim (OLMo-core's HSDP gradient group; torch >= 2.10).
needs_flatten_of_flattened = pytest.mark.skipif(
    _before((2, 10)),
    reason=f"{_FOUND} cannot _flatten a view holding a flattened dim (torch >= 2.10 can)",
)
