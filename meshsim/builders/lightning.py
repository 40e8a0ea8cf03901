"""Lightning builder: ``ModelParallelStrategy``'s (data_parallel, tensor_parallel) mesh in torch.

Replays ``setup_environment`` ("auto" sizes: nodes for ``data_parallel_size``, processes per node
for ``tensor_parallel_size``) and ``_setup_device_mesh`` (one product check, then
``init_device_mesh``) on live torch, and observes the two dims the strategy hands out: the
sampler's ``data_parallel`` dim and the ``tensor_parallel`` dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders._common import FrameworkRejection, collect, mesh
from meshsim.checks import Observation


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Example (world 8): ``{"num_nodes": 2}`` resolves "auto" to (2, 4); ``tensor_parallel``
    is ``(0, 1, 2, 3)`` on rank 0."""
    dp, tp = sizes(world_size, config)
    root = mesh((dp, tp), ("data_parallel", "tensor_parallel"))
    return collect({name: root[name] for name in ("data_parallel", "tensor_parallel")})


def sizes(world_size: int, config: Mapping[str, Any]) -> tuple[int, int]:
    """The (data_parallel_size, tensor_parallel_size) Lightning hands ``init_device_mesh``."""
    nodes = config.get("num_nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise FrameworkRejection(f"num_nodes must be an integer >= 1, got {nodes!r}")
    if world_size % nodes:
        raise FrameworkRejection(f"world size {world_size} is not a multiple of {nodes} nodes")
    dp = config.get("data_parallel_size", "auto")
    tp = config.get("tensor_parallel_size", "auto")
    dp = nodes if dp == "auto" else dp
    tp = world_size // nodes if tp == "auto" else tp
    for key, value in (("data_parallel_size", dp), ("tensor_parallel_size", tp)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise FrameworkRejection(f"{key} must be an integer or 'auto', got {value!r}")
    if dp * tp != world_size:
        raise FrameworkRejection(
            f"The sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied "
            f"should equal the world size ({world_size}).",
            upstream="RuntimeError",
        )
    return dp, tp
