"""Real Lightning adapter: ``ModelParallelStrategy.setup_environment`` on the harness's world.

Drives lightning 2.6.6's own strategy object, no Trainer: the Trainer would launch processes,
pick an accelerator and attach a LightningModule, so the adapter hands the strategy what the
Trainer would (a CPU accelerator, one CPU device per process of a node, ``num_nodes``, a bare
``LightningModule`` for ``setup_environment`` to attach the mesh to, and a cluster environment
that reports the harness's rank). ``setup_environment`` then runs unchanged: its
``_setup_distributed`` finds the default process group initialised and keeps it, resolves the
"auto" sizes, and calls ``_setup_device_mesh``. What is observed is the strategy's own
``device_mesh``, and ``distributed_sampler_kwargs`` is checked against its ``data_parallel`` dim.
Not driven: ``Trainer.fit`` and ``configure_model`` (the user's parallelisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from meshsim.builders._common import FrameworkRejection, collect
from meshsim.builders.real import _shims
from meshsim.builders.real._adapter import check_keys, framework_refusals
from meshsim.checks import Observation

Flavour = Literal["pytorch", "fabric"]


def build(world_size: int, config: Mapping[str, Any]) -> Observation:
    """Example (world 4): ``{"num_nodes": 2}`` gives Lightning's (2, 2) mesh: rank 1 holds
    ``data_parallel`` ``(1, 3)`` and ``tensor_parallel`` ``(0, 1)``."""
    check_keys("lightning", config)
    strategy = set_up("pytorch", world_size, config)
    mesh = strategy.device_mesh
    sampler = strategy.distributed_sampler_kwargs
    data = mesh["data_parallel"]
    if (sampler["num_replicas"], sampler["rank"]) != (data.size(), data.get_local_rank()):
        raise AssertionError(f"distributed_sampler_kwargs {sampler} disagree with {data}")
    return collect({"data_parallel": data, "tensor_parallel": mesh["tensor_parallel"]})


def set_up(flavour: Flavour, world_size: int, config: Mapping[str, Any]) -> Any:
    """Lightning's PyTorch (Trainer) or Fabric ``ModelParallelStrategy``, after its own
    ``setup_environment`` on this rank; raises ``FrameworkRejection`` where Lightning refuses."""
    nodes = config.get("num_nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise FrameworkRejection(f"num_nodes={nodes!r} does not split a world of {world_size}")
    per_node = world_size // nodes
    sizes = {
        "data_parallel_size": config.get("data_parallel_size", "auto"),
        "tensor_parallel_size": config.get("tensor_parallel_size", "auto"),
    }
    with _shims.unchanged_environ():
        strategy = _strategy(flavour, sizes)
        strategy.cluster_environment = _environment(per_node)
        strategy.parallel_devices = [torch.device("cpu")] * per_node
        strategy.num_nodes = nodes
        with framework_refusals():
            strategy.setup_environment()
    return strategy


def _strategy(flavour: Flavour, sizes: Mapping[str, Any]) -> Any:
    if flavour == "fabric":
        fabric, accelerators = _shims.load(
            "lightning.fabric.strategies.model_parallel", "lightning.fabric.accelerators"
        )
        strategy = fabric.ModelParallelStrategy(parallelize_fn=lambda module, _: module, **sizes)
        strategy.accelerator = accelerators.CPUAccelerator()
        return strategy
    trainer, accelerators, pl = _shims.load(
        "lightning.pytorch.strategies.model_parallel",
        "lightning.pytorch.accelerators",
        "lightning.pytorch",
    )
    strategy = trainer.ModelParallelStrategy(**sizes)
    strategy.accelerator = accelerators.CPUAccelerator()
    strategy._lightning_module = pl.LightningModule()  # setup_environment hands it the mesh
    return strategy


def _environment(per_node: int) -> Any:
    """A ``ClusterEnvironment`` reporting the harness's ranks (Lightning's own environments read
    ``os.environ``, which the harness's threaded tier shares between ranks)."""
    (environments,) = _shims.load("lightning.fabric.plugins.environments")
    rank = dist.get_rank()

    class HarnessEnvironment(environments.ClusterEnvironment):  # type: ignore[misc]
        def __init__(self) -> None:
            self._world_size = dist.get_world_size()
            self._global_rank = rank

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return True

        def world_size(self) -> int:
            return self._world_size

        def set_world_size(self, size: int) -> None:
            self._world_size = size

        def global_rank(self) -> int:
            return self._global_rank

        def set_global_rank(self, rank: int) -> None:
            self._global_rank = rank

        def local_rank(self) -> int:
            return rank % per_node

        def node_rank(self) -> int:
            return rank // per_node

    return HarnessEnvironment()
