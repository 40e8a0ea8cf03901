"""Forget DTensor's cached plans from an earlier run in a reused (warm-pool) worker.

The harness does this between jobs and between fake ranks
(``meshsim.torch_private.forget_dtensor_plans``); a body that may run outside the harness
(under torchrun, or in a user's own loop) calls this first to be safe.
"""

from __future__ import annotations

from meshsim.torch_private import forget_dtensor_plans as fresh_dtensor_caches

__all__ = ["fresh_dtensor_caches"]
