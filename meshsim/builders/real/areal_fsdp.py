"""Real AReaL FSDP adapter: AReaL 1.0.4's own ``ParallelHelper.build_mesh`` on this rank.

``build(world_size, config)`` makes AReaL's ``FSDPParallelStrategy(**config)`` (its
``__post_init__`` runs the expert-model-parallel check), hands it to
``ParallelHelper.from_parallel_strategy`` (the pipeline assert, ``_validate``) as
``FSDPEngine.create_process_group`` does, reads ``helper.world_mesh`` (``build_mesh`` on
``current_platform.device_type``: cpu on gloo) and observes every root dim and every name AReaL
flattened on it (``dp_sp``, ``sp_tp``; with EP ``dp`` and ``ep``). AReaL reads the world size
from torch.distributed; ``world_size`` is only the harness's. Tested with areal 1.0.4 on torch
2.10 (``pip install 'meshsim[areal]'``; the pin needs torch >= 2.9.1, < 2.11).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim import torch_private
from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run AReaL's mesh code for ``config`` and observe the mesh by AReaL's names.

    Example (world 8): ``{"data_parallel_size": 4, "tensor_parallel_size": 2}`` builds the
    (dp, sp, tp) = (4, 1, 2) mesh; ``dp_sp`` is observed as ``(0, 2, 4, 6)``, ``(1, 3, 5, 7)``.
    """
    check_keys("areal-fsdp", config)
    del world_size
    alloc_mode, parallel = _shims.load("areal.api.alloc_mode", "areal.engine.fsdp_utils.parallel")
    with _shims.unchanged_environ(), framework_refusals():
        strategy = alloc_mode.FSDPParallelStrategy(**config)
        helper = parallel.ParallelHelper.from_parallel_strategy(strategy)
        root = helper.world_mesh
    entries: dict[str, Entry] = {str(d): root[d] for d in root.mesh_dim_names or ()}
    for name in torch_private.flatten_mapping(root):
        entries[str(name)] = root[name]
    return collect(entries)
