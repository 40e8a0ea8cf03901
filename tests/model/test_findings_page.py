"""docs/findings.md: each finding's minimal config gives the finding the page names (and the
Megatron-DeepSpeed one, not a bug, gives none). Reference-level: the page's commands run in
tests/test_docs_examples.py; this pins what they show."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.model.invariants import find_violations

CASES: list[tuple[str, int, dict[str, Any], set[str]]] = [
    ("verl", 4, {"strategy": "torchtitan", "data_parallel_shard_size": 2,
                 "context_parallel_size": 2}, {"context peers share the data-parallel rank"}),
    ("verl", 4, {"fsdp_size": 1}, {"gradient_reduce ⊇ data_parallel"}),
    ("verl", 4, {"fsdp_size": 1, "ulysses_sequence_parallel_size": 4},
     {"gradient_reduce ⊇ context"}),
    ("accelerate", 4, {"dp_shard_size": 2, "cp_size": 2, "distributed_type": "DEEPSPEED"},
     {"context peers share the data-parallel rank"}),
    ("accelerate", 4, {"dp_shard_size": 2, "tp_size": 2, "dispatch_batches": True},
     {"gradient-reduce peers load different batches"}),
    ("accelerate", 4, {"dp_shard_size": 2, "tp_size": 2, "distributed_type": "MULTI_GPU"},
     {"gradient_reduce ⊇ data_parallel"}),
    ("megatron-deepspeed", 8, {"sequence_parallel_size": 2}, set()),
]  # fmt: skip


@pytest.mark.parametrize(("framework", "world", "config", "checks"), CASES)
def test_the_pages_minimal_configs_show_their_findings(
    framework: str, world: int, config: dict[str, Any], checks: set[str]
) -> None:
    found = find_violations(meshsim.expect(framework, world, **config))
    assert {v.check for v in found} == checks


def test_without_dispatch_the_tp_fsdp_loader_is_sound() -> None:
    expected = meshsim.expect("accelerate", 4, dp_shard_size=2, tp_size=2)
    assert find_violations(expected) == []
