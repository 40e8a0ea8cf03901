"""Cross-check: builders against the real frameworks' own rank arithmetic (when installed).

No process groups of the framework are made here (that is the real adapters' job): Megatron's
``RankGenerator`` and DeepSpeed's ``ProcessTopology`` / ``_get_expert_parallel_ranks`` are pure
functions, so their groups can be compared with what torch built from the builders' recipes.
"""

from __future__ import annotations

import itertools

import pytest

import meshsim
from tests.builders._ranks import on_rank

pytestmark = pytest.mark.filterwarnings("ignore")

DENSE_TOKENS = ("dp", "dp-cp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp")
CONFIG = {"tensor_model_parallel_size": 2, "context_parallel_size": 2,
          "pipeline_model_parallel_size": 2, "expert_tensor_parallel_size": 4}  # fmt: skip


def _accepted(order: str) -> bool:
    try:
        meshsim.expect("megatron", 16, **CONFIG, order=order)
    except meshsim.LayoutError:  # e.g. pp not last and expert dp != dense dp
        return False
    return True


ORDERS = [
    order
    for order in ("-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp")))
    if _accepted(order)
]


@pytest.mark.requires_framework("megatron")
@pytest.mark.parametrize("order", ORDERS)
def test_megatron_builder_equals_rank_generator(order: str) -> None:
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    generator = parallel_state.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order=order)
    for rank in (0, 5, 10, 15):
        obs = on_rank("megatron", 16, {**CONFIG, "order": order}, rank)
        for token in DENSE_TOKENS:
            want = next(g for g in generator.get_ranks(token) if rank in g)
            assert obs.groups[token].members == tuple(want), (order, rank, token)


@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 4), (2, 2, 2), (1, 2, 4)])
def test_deepspeed_builder_equals_topology_and_moe_ranks(
    tp: int, pp: int, ep: int, before: bool
) -> None:
    groups = pytest.importorskip("deepspeed.utils.groups")
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    world = 16
    experts, expert_data = groups._get_expert_parallel_ranks(world, tp, ep, pp, before)
    topo = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    config = {
        "num_pp": pp,
        "num_mp": tp,
        "ep": ep,
        "use_data_before_expert_parallel_": before,
        "enable_expert_tensor_parallelism": True,  # the _get_expert_parallel_ranks path
    }
    for rank in range(0, world, 3):
        obs = on_rank("deepspeed", world, config, rank)
        families = {"expert": experts, "expert_data": expert_data}
        families.update(
            {axis: topo.get_axis_comm_lists(axis) for axis in ("pipe", "data", "model")}
        )
        for kind, family in families.items():
            want = next(g for g in family if rank in g)
            assert obs.groups[kind].members == tuple(want), (kind, rank)
