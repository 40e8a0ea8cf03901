"""torch's DeviceMesh layout algebra, answered once per fake run instead of once per rank.

Every rank of a fake run builds the same meshes, so torch's ``_mesh_layout`` algebra (CuTe
layouts: collapse, complement, the rank tensor of a layout) is asked the same questions by
every rank: at 1,024 ranks it was a fifth of the run. Those methods are pure functions of
frozen dataclasses (and, for ``remap_to_tensor``, of a rank tensor's values), so for the
length of one fake run each answer is kept and handed out again; a tensor answer is handed
out as a copy, so no rank can alter another's. Nothing else changes: a method a release
lacks is left alone, and an argument that cannot be a key goes to torch's own method.
``MESHSIM_FAKE_FASTPATH=0`` turns this off with the non-member fast path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from meshsim import torch_private

#: Methods that compute from their arguments and the frozen layout alone.
PURE = ("remap_to_tensor", "collapse", "complement", "check_orthogonal", "cosize", "numel")


class LayoutMemo:
    """Installs memoised forms of :data:`PURE` on torch's layout classes for one run."""

    def __init__(self) -> None:
        self._originals: list[tuple[type, str, Callable[..., Any]]] = []

    def install(self) -> None:
        for cls in torch_private.mesh_layout_classes():
            for name in PURE:
                original = vars(cls).get(name)
                if callable(original) and not isinstance(original, (staticmethod, classmethod)):
                    self._originals.append((cls, name, original))
                    setattr(cls, name, _memoised(original))

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._originals):
            setattr(cls, name, original)
        self._originals.clear()


def _memoised(method: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    answers: dict[tuple, Any] = {}

    @functools.wraps(method)
    def memoised(self: Any, *args: Any) -> Any:
        try:
            key = (self, *(_key(a, torch.Tensor) for a in args))
            answer = answers.get(key, answers)
        except Exception:  # unhashable, or a tensor numpy cannot read: torch decides
            return method(self, *args)
        if answer is answers:
            answer = answers[key] = method(self, *args)
        return answer.clone() if isinstance(answer, torch.Tensor) else answer

    return memoised


def _key(arg: Any, tensor_type: type) -> Any:
    if isinstance(arg, tensor_type):
        return (arg.dtype, tuple(arg.shape), arg.device.type, arg.cpu().numpy().tobytes())
    return arg
