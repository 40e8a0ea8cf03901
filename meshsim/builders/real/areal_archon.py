"""Real AReaL Archon adapter: AReaL 1.0.4's own ``ArchonParallelDims`` on this rank.

``build(world_size, config)`` makes ``ArchonParallelDims(**config, world_size=world_size,
device_type=...)`` as ``ArchonEngine.create_process_group`` does (``__post_init__`` infers
dp_shard and raises its ``ValueError`` refusals), builds its mesh and observes
``get_mesh(name)`` for every name the class documents, in a fixed order; a name it returns
``None`` for is recorded absent. ``ep_tp`` is a 2-D mesh, observed as one group per ``ep x tp``
block. Tested with areal 1.0.4 on torch 2.10 (``pip install 'meshsim[areal]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation

#: Every name ``ArchonParallelDims.get_mesh`` can hand out, in the reference's kind order.
NAMES = (
    "pp",
    "dp_shard",
    "dp_shard_mod_ep",
    "dp_shard_in_ep",
    "cp",
    "tp",
    "dp",
    "dp_shard_cp",
    "dp_cp",
    "pp_cp_tp",
    "ep",
    "ep_tp",
)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run AReaL's ``ArchonParallelDims`` for ``config`` and observe every ``get_mesh`` name.

    Example (world 8): ``{"tp": 2, "ep": 2, "etp": 2}`` infers dp_shard=4, builds (pp,
    dp_shard_mod_ep, dp_shard_in_ep, cp, tp) = (1, 2, 2, 1, 2); ``ep_tp`` is observed as
    ``(0, 1, 2, 3)`` and ``(4, 5, 6, 7)``.
    """
    check_keys("areal-archon", config)
    (module,) = _shims.load("areal.experimental.models.archon.parallel_dims")
    with _shims.unchanged_environ(), framework_refusals():
        dims = module.ArchonParallelDims(
            **config, world_size=world_size, device_type=_shims.device_type()
        )
        dims.build_mesh()
    entries: dict[str, Entry] = {name: dims.get_mesh(name) for name in NAMES}
    return collect(entries)
