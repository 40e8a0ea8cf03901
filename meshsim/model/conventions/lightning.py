"""Lightning ``ModelParallelStrategy``: a ``(data_parallel, tensor_parallel)`` device mesh.

Modelled on lightning 2.6.6: ``lightning/fabric/strategies/model_parallel.py`` (
``_setup_device_mesh``, used by both strategies) and the ``setup_environment`` /
``distributed_sampler_kwargs`` of ``lightning/pytorch/strategies/model_parallel.py`` and its
Fabric twin. ``"auto"`` sizes resolve in ``setup_environment``: ``data_parallel_size`` to the
number of nodes, ``tensor_parallel_size`` to the processes of one node (world / nodes). The only
check is that the two sizes multiply to the world (``RuntimeError``); the mesh is then
``init_device_mesh(shape=(dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))``, so
tensor-parallel peers are consecutive ranks.

Lightning applies no parallelism itself: the user's ``configure_model`` (``parallelize_fn`` in
Fabric) does, and Lightning's documented recipe shards with FSDP2 over
``device_mesh["data_parallel"]``; the sampler reads its ``num_replicas``/``rank`` off that dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model import torch_release as _torch_release
from meshsim.model.conventions import reject_unknown
from meshsim.model.expected import Expected, layout_kind
from meshsim.model.layout import Layout
from meshsim.model.sweep import divisors

__all__ = ["PARAMETERS", "configs", "expect", "refused_configs"]

PARAMETERS: Final[Mapping[str, str]] = {
    "data_parallel_size": "ModelParallelStrategy(data_parallel_size=...): int, or 'auto' "
    "(default: the number of nodes)",
    "tensor_parallel_size": "ModelParallelStrategy(tensor_parallel_size=...): int, or 'auto' "
    "(default: the processes of one node, world / num_nodes)",
    "num_nodes": "Trainer(num_nodes=...) / Fabric(num_nodes=...), read only by the 'auto' sizes "
    "(default 1)",
}

DIMS: Final = ("data_parallel", "tensor_parallel")
_DESCRIPTIONS: Final[Mapping[str, str]] = {
    "data_parallel": "device_mesh['data_parallel']: distributed_sampler_kwargs (num_replicas, "
    "rank) and the FSDP2 mesh of Lightning's recipe",
    "tensor_parallel": "device_mesh['tensor_parallel']: the mesh parallelize_module shards over",
}


def expect(world_size: int, **config: Any) -> Expected:
    """The mesh ``ModelParallelStrategy.setup_environment`` builds on ``world_size`` ranks.

    Example: ``expect(8, data_parallel_size=2, tensor_parallel_size=4)`` has tensor_parallel
    groups ``(0, 1, 2, 3)``, ``(4, 5, 6, 7)`` and data_parallel groups ``(0, 4)``, ``(1, 5)``,
    ...; ``expect(8, num_nodes=2)`` resolves "auto" to the same (2, 4) mesh.
    """
    reject_unknown("lightning", config, PARAMETERS)
    dp, tp, nodes = _resolve(world_size, config)
    root = Layout([("data_parallel", dp), ("tensor_parallel", tp)])
    kinds = [layout_kind(root, dim, _DESCRIPTIONS[dim], dim) for dim in DIMS]
    roles = {
        "data_parallel": "data_parallel",
        "gradient_reduce": "data_parallel",
        "tensor": "tensor_parallel",
    }
    normal = {"data_parallel_size": dp, "tensor_parallel_size": tp, "num_nodes": nodes}
    return Expected("lightning", world_size, normal, kinds, roles, layout=root)


def _resolve(world_size: int, config: Mapping[str, Any]) -> tuple[int, int, int]:
    """``setup_environment``'s "auto" resolution, then ``_setup_device_mesh``'s one check."""
    nodes = config.get("num_nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise LayoutError(f"num_nodes must be an integer >= 1, got {nodes!r}")
    if world_size % nodes != 0:
        raise LayoutError(
            f"Lightning's world is num_nodes x devices per node; world size {world_size} is not "
            f"a multiple of num_nodes={nodes}"
        )
    sizes: dict[str, int] = {}
    for key, auto in (("data_parallel_size", nodes), ("tensor_parallel_size", world_size // nodes)):
        value = config.get(key, "auto")
        if value == "auto":
            value = auto
        elif isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{key} must be an integer or 'auto', got {value!r}")
        sizes[key] = value
    dp, tp = sizes["data_parallel_size"], sizes["tensor_parallel_size"]
    if dp * tp != world_size:
        raise LayoutError(
            f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied "
            f"should equal the world size ({world_size}).",
            upstream="RuntimeError",
        )
    if dp < 1 or tp < 1:  # two negative sizes pass Lightning's product check; torch refuses
        raise LayoutError(
            f"init_device_mesh refuses mesh_shape ({dp}, {tp}): a negative dim size (Lightning "
            "checks only that the sizes multiply to the world)",
            upstream=_torch_release.negative_mesh_dim_error(),
        )
    return dp, tp, nodes


def configs(world_size: int, **options: Any) -> Iterator[dict[str, Any]]:
    """Every explicit (dp, tp) split of the world, then the all-"auto" default per node count,
    then one size "auto" beside the other given, per node count between 1 and the world.

    ``auto=False`` drops the "auto" configs (each repeats an explicit split). World 8 gives 12.
    """
    for dp in divisors(world_size):
        yield {"data_parallel_size": dp, "tensor_parallel_size": world_size // dp}
    if options.get("auto", True):
        for nodes in divisors(world_size):
            yield {"num_nodes": nodes} if nodes > 1 else {}
        # Each "auto" alone: the strategy resolves the two sizes in separate branches.
        for nodes in divisors(world_size)[1:-1]:
            yield {"data_parallel_size": nodes, "num_nodes": nodes}
            yield {"tensor_parallel_size": world_size // nodes, "num_nodes": nodes}


def refused_configs(world_size: int) -> Iterator[dict[str, Any]]:
    """Configs Lightning rejects (``RuntimeError``): sizes whose product is not the world
    (an explicit size beside an "auto" one included), a size of 0, and two negative sizes,
    which pass Lightning's product check and fail in ``init_device_mesh`` (an AssertionError
    on torch 2.10-2.12)."""
    yield {"data_parallel_size": world_size, "tensor_parallel_size": 2}
    yield {"data_parallel_size": 0, "tensor_parallel_size": world_size}
    if world_size > 1:
        yield {"tensor_parallel_size": world_size // 2 or 1, "data_parallel_size": "auto"}
        smallest = divisors(world_size)[1]
        yield {"data_parallel_size": -smallest, "tensor_parallel_size": -(world_size // smallest)}
