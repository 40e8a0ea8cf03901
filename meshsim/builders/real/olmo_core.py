"""Real OLMo-core adapter: ``build_world_mesh`` and every ``get_*_mesh`` getter of ai2-olmo-core.

``build(world_size, config)`` turns meshsim's OLMo config (``meshsim.model.conventions.olmo_core``
parameters) into OLMo's own config objects (``DataParallelConfig(name=..., num_replicas=...,
shard_degree=...)``, ``TensorParallelConfig(degree=...)``, ...), calls
``olmo_core.distributed.parallel.build_world_mesh`` (and ``build_expert_parallel_mesh`` for
``expert_mesh_ep``), then calls OLMo's getters on the mesh it built, in the order meshsim's
reference lists them. Kinds are named as the reference names them: the world mesh's dims, one
kind per getter (``get_dp_model_mesh``, ...), every name OLMo flattened on the root (``dp_cp``,
``dp``), and the expert mesh's getters/flattened names prefixed ``expert:``. A getter that raises
is recorded as absent, so the diff checks that the reference expects it to raise.
Tested with ai2-olmo-core 3.0.0 (``pip install 'meshsim[olmo-core]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshsim import torch_private
from meshsim.builders._common import Entry, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation
from meshsim.model.layout import Layout

#: Getters observed on each mesh, in the reference's order (names are OLMo's function names).
GETTERS = (
    "get_dp_mesh",
    "get_dp_process_group",
    "get_dp_model_mesh",
    "get_tp_mesh",
    "get_cp_mesh",
    "get_pp_mesh",
    "get_pp_stage_mesh",
    "get_ep_mesh",
    "get_dp_shard_mesh",
    "get_dp_replicate_mesh",
)


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Run OLMo's mesh code for ``config`` on this rank and observe every getter by kind name.

    Example (world 8): ``{"dp": "hsdp", "num_replicas": 2, "cp": 2}`` builds OLMo's
    (dp_replicate, dp_shard, cp) = (2, 2, 2) mesh; ``get_dp_model_mesh`` is its 2-D
    (dp_replicate, dp_cp) sub-mesh, observed as one group of all 8 ranks.
    """
    check_keys("olmo-core", config)
    (parallel,) = _shims.load("olmo_core.distributed.parallel")
    del world_size  # OLMo reads the world size from torch.distributed itself
    device = _shims.device_type()
    with framework_refusals():
        kwargs = _configs(parallel, config)
    with (
        _shims.unchanged_environ(),
        _shims.olmo_fresh_world_mesh(),
        _shims.olmo_num_nodes(config.get("num_nodes") or 1),
    ):
        with framework_refusals():
            world = parallel.build_world_mesh(**kwargs, device_type=device)
        entries = _mesh_entries(parallel, world, prefix="")
        if config.get("expert_mesh_ep") is not None:
            with framework_refusals():
                ep = parallel.ExpertParallelConfig(degree=config["expert_mesh_ep"])
                expert = parallel.build_expert_parallel_mesh(ep, device_type=device)
            entries.update(_mesh_entries(parallel, expert, prefix="expert:"))
        return collect(entries)


def expert_mesh(world_size: int, config: Mapping[str, Any]) -> Layout:
    """OLMo's own ``build_expert_parallel_mesh`` as a :class:`Layout` (its dim names and rank
    array), to compare with ``Expected.meshes["expert"]``; run on every rank."""
    (parallel,) = _shims.load("olmo_core.distributed.parallel")
    del world_size
    with _shims.unchanged_environ(), _shims.olmo_fresh_world_mesh():
        with framework_refusals():
            ep = parallel.ExpertParallelConfig(degree=config["expert_mesh_ep"])
            mesh = parallel.build_expert_parallel_mesh(ep, device_type=_shims.device_type())
        return Layout.from_mesh(mesh.mesh.tolist(), mesh.mesh_dim_names)


def _configs(parallel: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """meshsim's OLMo keys -> ``build_world_mesh`` keyword arguments (OLMo config objects)."""
    kwargs: dict[str, Any] = {}
    dp = config.get("dp")
    if dp is not None:
        kwargs["dp"] = parallel.DataParallelConfig(
            name=parallel.DataParallelType(str(getattr(dp, "value", dp))),
            num_replicas=config.get("num_replicas"),
            shard_degree=config.get("shard_degree"),
        )
    classes: dict[str, Callable[..., Any]] = {
        "tp": parallel.TensorParallelConfig,
        "cp": parallel.ContextParallelConfig,
        "pp": parallel.PipelineParallelConfig,
        "ep": parallel.ExpertParallelConfig,
    }
    for key, cls in classes.items():
        if config.get(key) is not None:
            kwargs[key] = cls(degree=config[key])
    return kwargs


def _mesh_entries(parallel: Any, root: Any, prefix: str) -> dict[str, Entry]:
    """Root dims, then each getter's result (or what it raised), then OLMo's flattened names.

    Getters run in a fixed order on every rank (they create flattened process groups, which is
    collective). Dims keep their names; getters and flattened names take ``prefix``.
    """
    entries: dict[str, Entry] = {_plain(dim): root[dim] for dim in root.mesh_dim_names or ()}
    for name in GETTERS:
        try:
            entries[prefix + name] = getattr(parallel, name)(root)
        except (RuntimeError, KeyError, ValueError, AssertionError) as error:
            entries[prefix + name] = error
    for alias, flat in torch_private.flatten_mapping(root).items():
        entries.setdefault(prefix + _plain(alias), flat)
    return entries


def _plain(name: Any) -> str:
    """OLMo names dims with its ``MeshDimName`` StrEnum; kind names must be plain ``str`` so
    the Observation unpickles in the caller without importing olmo_core there."""
    return str(getattr(name, "value", name))
