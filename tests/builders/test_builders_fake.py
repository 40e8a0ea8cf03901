"""Every builder, every rank, fake backend: the live groups equal the reference, kind by kind."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim.builders import BUILDERS, build
from meshsim.checks import diff
from meshsim.errors import LayoutError, UsageError
from tests.builders._ranks import build_every_rank, on_rank, refused_by_this_release
from tests.builders.cases import REJECTED, REJECTED_IDS, UNOBSERVED, VALID, VALID_IDS

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")


@pytest.mark.parametrize(("framework", "world", "config"), VALID, ids=VALID_IDS)
def test_builder_matches_reference_on_every_rank(
    framework: str, world: int, config: dict[str, Any]
) -> None:
    refusal = refused_by_this_release(framework, world, config)
    if refusal:
        pytest.skip(refusal)
    expected = meshsim.expect(framework, world, **config)
    observed = build_every_rank(framework, world, config)
    assert diff(observed, expected) is None
    # The builder covers every kind the reference names, raising getters included; a derived
    # kind (a role's product of dims, no process group) is no group a program builds.
    seen = {name for obs in observed for name in (*obs.groups, *obs.absent)}
    wanted = set(expected.kinds()) | set(expected.unavailable())
    wanted -= set(expected.derived_kinds())
    assert not set(expected.derived_kinds()) & seen
    assert wanted - seen <= UNOBSERVED.get(framework, set())


@pytest.mark.parametrize(("framework", "world", "config"), REJECTED, ids=REJECTED_IDS)
def test_builder_rejects_what_the_framework_rejects(
    framework: str, world: int, config: dict[str, Any]
) -> None:
    with pytest.raises(LayoutError) as reference:
        meshsim.expect(framework, world, **config)
    with pytest.raises((RuntimeError, ValueError, KeyError, AssertionError)) as built:
        build_every_rank(framework, world, config)
    upstream = getattr(built.value, "upstream", type(built.value).__name__)
    if reference.value.upstream and upstream:
        assert upstream == reference.value.upstream, (str(reference.value), str(built.value))


def test_unavailable_getter_is_recorded_absent_not_built() -> None:
    # OLMo: HSDP + CP folds dp_shard into dp_cp, so get_dp_shard_mesh raises in OLMo.
    config = {"dp": "hsdp", "num_replicas": 2, "cp": 2}
    expected = meshsim.expect("olmo-core", 8, **config)
    assert "get_dp_shard_mesh" in expected.unavailable()
    obs = on_rank("olmo-core", 8, config, rank=5)
    assert "get_dp_shard_mesh" in obs.absent and "get_dp_shard_mesh" not in obs.groups
    model = obs.groups["get_dp_model_mesh"]
    assert model.mesh == [[0, 1, 2, 3], [4, 5, 6, 7]]  # (dp_replicate, dp_cp), 2-D
    assert obs.groups["get_dp_process_group"].members == (1, 3, 5, 7)  # no cp


def test_megatron_embedding_groups_come_from_pipelines() -> None:
    config = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4}
    middle = on_rank("megatron", 16, config, rank=5)
    assert "embedding" in middle.absent  # stage 1 of 4 ties no embedding
    first = on_rank("megatron", 16, config, rank=1)
    assert first.groups["embedding"].members == (1, 13)
    assert first.groups["position_embedding"].members == (1,)
    assert first.groups["pp"].members == (1, 5, 9, 13)


def test_order_string_is_the_reversed_mesh_shape() -> None:
    obs = on_rank("megatron", 8, {"tensor_model_parallel_size": 2, "order": "pp-dp-tp"}, rank=1)
    # pp-dp-tp: pp fastest (size 1), dp next (4), tp slowest (2): tp stride 4.
    assert obs.groups["tp"].members == (1, 5)
    assert obs.groups["dp"].members == (0, 1, 2, 3)


def test_registry() -> None:
    assert set(BUILDERS) == set(meshsim.CONVENTIONS)
    with pytest.raises(UsageError, match="no builder for framework 'jax'"):
        build("jax", 4, {})
