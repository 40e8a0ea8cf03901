"""Real torchtitan adapter: ``ParallelDims(...).build_mesh()`` and every public getter.

``build(world_size, config)`` turns meshsim's torchtitan config into torchtitan's own
``ParallelDims(dp_replicate=..., dp_shard=..., cp=..., tp=..., pp=..., ep=..., world_size=...,
spmd_backend=...)``, builds its meshes and records every answer its public API gives
(``meshsim.builders._torchtitan_api``): ``get_mesh`` and ``get_optional_mesh`` (with and without
``include_singleton_axes``) of every axis and multi-axis request, ``world_mesh``, each global
view's dims, ``spmd_meshes()``, ``spmd_dense_mesh()``, ``spmd_sparse_mesh()`` and
``get_dense_tp_mesh()``. A call that raises or returns None is recorded as absent; fake-backed
meshes are recorded from their rank tensor, unproven (the fake backend cannot communicate).
Only the code torchtitan 0.3.0 ships is modelled here: ``version="current"``; the reference's
``intermediate`` / ``legacy`` / ``hyper_parallel`` versions are older or forked code this package
does not contain, so asking for them raises :class:`~meshsim.errors.UsageError`.
Tested with torchtitan 0.3.0 (``pip install 'meshsim[torchtitan]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders import _torchtitan_api as titan_api
from meshsim.builders.real import _shims, outside_adapter
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation
from meshsim.errors import UsageError

#: meshsim config key -> ``ParallelismConfig`` field (torchtitan's job config), with defaults.
FIELDS: Mapping[str, tuple[str, int]] = {
    "dp_replicate": ("data_parallel_replicate_degree", 1),
    "dp_shard": ("data_parallel_shard_degree", -1),
    "cp": ("context_parallel_degree", 1),
    "tp": ("tensor_parallel_degree", 1),
    "pp": ("pipeline_parallel_degree", 1),
    "ep": ("expert_parallel_degree", 1),
}


def parallel_dims(world_size: int, config: Mapping[str, Any]) -> Any:
    """torchtitan's ``ParallelDims`` for a meshsim config, made the way its trainer makes it:
    ``ParallelDims.from_config(ParallelismConfig(...), world_size)``, so both validate it
    (``ParallelismConfig`` refuses an unknown ``spmd_backend`` with ValueError; a bare
    ``ParallelDims`` would take any string for ``partial_dtensor``)."""
    check_keys("torchtitan", config)
    dims_module, config_module = _shims.load(
        "torchtitan.distributed.parallel_dims", "torchtitan.config.configs"
    )
    outside = outside_adapter("torchtitan", config)
    if outside is not None:
        raise UsageError(outside)
    kwargs = {field: config.get(key, default) for key, (field, default) in FIELDS.items()}
    if config.get("spmd_backend") is not None:
        kwargs["spmd_backend"] = config["spmd_backend"]
    with framework_refusals():
        parallelism = config_module.ParallelismConfig(**kwargs)
        return dims_module.ParallelDims.from_config(parallelism, world_size)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Build torchtitan's meshes for ``config`` on this rank; observe every public getter's
    answer (``meshsim.builders._torchtitan_api``: ``get_mesh`` / ``get_optional_mesh`` of every
    axis and multi-axis request, each global view's dims, ``spmd_meshes()``, ...).

    Example (world 8): ``{"dp_shard": 4, "tp": 2, "ep": 2}`` gives ``ep`` groups equal to the
    ``tp`` groups, ``(0, 1)``, ``(2, 3)``, ... (ep is the innermost axis of the sparse view).
    """
    _shims.register_fake_backend()
    dims = parallel_dims(world_size, config)
    with (
        _shims.unchanged_environ(),
        _shims.torchtitan_device(_shims.device_type()),
        framework_refusals(),
    ):
        dims.build_mesh()
    return titan_api.observe(titan_api.entries(dims))
