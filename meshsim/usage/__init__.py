"""Usage checks: the groups may be right and a step still use them wrong.

``assert_matches_serial`` runs a training step on N ranks and its serial twin on one rank and
compares every logged value, gradient and parameter; the reduction trace names the group each
parameter's gradient was reduced over. Importing this package does not import torch.
"""

from meshsim.usage.serial import Equivalence, assert_matches_serial
from meshsim.usage.step import StepContext

__all__ = ["Equivalence", "StepContext", "assert_matches_serial"]
