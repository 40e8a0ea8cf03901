"""Usage checks: the groups may be right and a step still use them wrong.

``assert_matches_serial`` runs a training step on N ranks and its serial twin on one rank and
compares every logged value, gradient and parameter; the reduction trace names the group each
parameter's gradient was reduced over. Importing this package does not import torch.
"""

from meshsim.usage.reduction_check import assert_gradient_reductions, check_reductions
from meshsim.usage.serial import Equivalence, assert_matches_serial
from meshsim.usage.step import StepContext
from meshsim.usage.trace import GradientTrace

__all__ = [
    "Equivalence",
    "GradientTrace",
    "StepContext",
    "assert_gradient_reductions",
    "assert_matches_serial",
    "check_reductions",
]
