"""Data-flow checks: the groups may be right and the trainer still use the wrong one.

``record_batches`` + ``assert_data_parallel`` prove what each rank *loaded* follows the
reference's data-parallel role; ``assert_gradient_sync`` proves what each rank *reduced*
follows its gradient role; ``meshsim.dataflow.recipes`` wires a tiny model the OLMo-core and
torchtitan way (and three classic wrong ways) to exercise both. Importing this package does not
import torch.
"""

from meshsim.dataflow.data_check import assert_data_parallel
from meshsim.dataflow.grad_check import assert_gradient_sync, loss_scale
from meshsim.dataflow.records import BatchRecord, record_batches

__all__ = [
    "BatchRecord",
    "assert_data_parallel",
    "assert_gradient_sync",
    "loss_scale",
    "record_batches",
]
