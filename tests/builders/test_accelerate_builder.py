"""accelerate builder vs the reference: fake (every rank, every config), threaded and gloo."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.checks import diff
from meshsim.errors import LayoutError
from meshsim.model.conventions.accelerate import configs, refused_configs
from meshsim.model.sweep import LayoutCase
from meshsim.verify import verify_many
from tests.builders._ranks import build_every_rank, on_rank

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")

CONFIGS_8 = list(configs(8))


@pytest.mark.parametrize("config", CONFIGS_8, ids=str)
def test_builder_matches_reference_on_every_fake_rank(config: dict[str, Any]) -> None:
    expected = meshsim.expect("accelerate", 8, **config)
    observed = build_every_rank("accelerate", 8, config)
    assert diff(observed, expected) is None
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    assert set(expected.kinds()) | set(expected.unavailable()) == seen


@pytest.mark.parametrize("config", list(refused_configs(8)), ids=str)
def test_builder_refuses_what_the_reference_refuses(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect("accelerate", 8, **config)
    with pytest.raises(RuntimeError) as built:
        on_rank("accelerate", 8, config, rank=0)
    assert getattr(built.value, "upstream", None) == reference.value.upstream


def test_builder_reads_the_live_mesh() -> None:
    obs = on_rank("accelerate", 8, {"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2},
                  rank=5)  # fmt: skip
    # fully_shard gets the 2-D (dp_replicate, dp_shard_cp) mesh: the whole world here
    assert obs.groups["fsdp_mesh"].mesh == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert obs.groups["dp_cp"].members == tuple(range(8))
    assert obs.groups["dp_shard_cp"].members == (4, 5, 6, 7)
    assert obs.groups["dataloader_batch_peers"].members == (4, 5)
    assert "tp" in obs.absent and "sp" in obs.absent
    outside = on_rank("accelerate", 8, {"autotp_size": 2}, rank=3)
    assert "ds:tp" in outside.absent  # the AutoTP mesh holds ranks 0 and 1 only
    assert outside.groups["dataloader_batch_peers"].members == (2, 3)


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_communicating_tiers(backend: str) -> None:
    cases = [
        LayoutCase("accelerate", 4, {"dp_shard_size": 2, "tp_size": 2}),
        LayoutCase("accelerate", 4, {"dp_replicate_size": 2, "dp_shard_size": 2}),
        LayoutCase("accelerate", 4, {"autotp_size": 2}),
        LayoutCase("accelerate", 4, {"tp_size": 4, "distributed_type": "FSDP", "version": "1.10"}),
    ]
    results = list(verify_many(cases, backend, timeout=120))
    for result in results:
        assert result.passed and result.rejected is None, str(result)
    assert "dataloader_replica" in results[0].kinds_checked
    assert "fsdp_mesh" in results[1].kinds_checked
