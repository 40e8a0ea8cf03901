"""Forget DTensor's cached plans from an earlier run in a reused (warm-pool) worker.

DTensor caches sharding propagation and redistribute plans keyed by specs whose meshes compare
equal across runs; a plan cached in the previous run of a gloo pool worker names process groups
that run destroyed ("Could not resolve the process group registered under the name 10"). A body
that builds DTensors calls this first. (The harness would be the better place: see the note.)
"""

from __future__ import annotations


def fresh_dtensor_caches() -> None:
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("_propagate_tensor_meta_cached",):
        cached = getattr(propagator, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    plans = getattr(_redistribute, "_gen_transform_infos", None)
    if plans is not None and hasattr(plans, "cache_clear"):
        plans.cache_clear()
