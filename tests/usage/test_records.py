"""What a rank's records cost the caller: float32 tensors kept as float32, and equal arrays
from different ranks held once after unpickling (a world of 8 records every full parameter)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from meshsim.usage.step import StepContext
from meshsim.usage.tensors import Captured

torch = pytest.importorskip("torch")


def _context() -> StepContext:
    return StepContext(
        rank=0, world_size=1, serial=True, expected=None, batch=None, steps=1, seed=0
    )


@pytest.mark.parametrize(
    ("dtype", "kept"),
    [
        (torch.float32, np.float32),
        (torch.bfloat16, np.float32),
        (torch.float16, np.float32),
        (torch.float64, np.float64),
        (torch.int64, np.float64),
    ],
)
def test_a_tensor_is_kept_at_the_narrowest_exact_width(dtype, kept) -> None:  # type: ignore[no-untyped-def]
    captured = _context()._capture(torch.arange(6).reshape(2, 3).to(dtype))
    assert captured.array.dtype == kept
    assert captured.dtype == str(dtype).removeprefix("torch.")
    assert captured.array.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_equal_arrays_from_different_ranks_are_one_after_unpickling() -> None:
    weights = np.linspace(0, 1, 1000, dtype=np.float32)
    ranks = [Captured(weights.copy(), "float32") for _ in range(8)]
    other = Captured(weights * 2, "float32")
    loss = Captured(np.array(0.5), "float64")  # 0-d stays 0-d
    out = pickle.loads(pickle.dumps([*ranks, other, loss]))
    assert all(c.array is out[0].array for c in out[:8])
    assert not out[0].array.flags.writeable
    assert out[8].array is not out[0].array and np.array_equal(out[8].array, weights * 2)
    assert out[9].array.shape == () and out[9].array == 0.5
