"""transformers convention: DistributedConfig sizes, the dense/expert meshes, the Trainer's mesh."""

from __future__ import annotations

from typing import Any

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import transformers
from meshsim.model.conventions._transformers_configs import configs, refused_configs

SINGLETONS = [(r,) for r in range(8)]
WORLD = [tuple(range(8))]


def hf(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("transformers", world, **config)


def shape(layout: meshsim.Layout | None) -> dict[str, int]:
    assert layout is not None
    return dict(zip(layout.root_names, layout.root_shape))


def test_fsdp_tp_ep_world_8() -> None:
    exp = hf(8, fsdp_size=4, tp_size=2, ep_size=4)
    assert shape(exp.layout) == {"pp": 1, "dp_replicate": 1, "fsdp": 4, "tp": 2}
    assert shape(exp.meshes["expert"]) == {"pp": 1, "dp_replicate": 1, "efsdp": 2, "ep": 4}
    assert exp.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("fsdp") == exp.groups("fsdp_mesh") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("pp") == exp.groups("dp_replicate") == SINGLETONS
    assert exp.groups("device_mesh") == WORLD  # (pp, fsdp, tp) of one model replica
    assert exp.groups("expert:ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("expert:efsdp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("expert:fsdp_mesh") == exp.groups("expert:efsdp")
    assert exp.groups("expert:pp") == exp.groups("expert:dp_replicate") == SINGLETONS
    assert dict(exp.roles) == {
        "data_parallel": "trainer:dataloader_replica",  # the Trainer's loader, = fsdp_mesh here
        "gradient_reduce": "fsdp_mesh",
        "tensor": "tp",
        "expert": "expert:ep",
        "expert_data": "expert:fsdp_mesh",
    }


def test_hsdp_tp_ep_world_8() -> None:
    exp = hf(8, dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=4)
    assert exp.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("fsdp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert exp.groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # HSDP: FSDP2 gets the 2-D (dp_replicate, fsdp) mesh, row-major.
    assert exp.kind("fsdp_mesh").mesh_dims == ("dp_replicate", "fsdp")
    assert exp.groups("fsdp_mesh") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("device_mesh") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # skips dp_replicate
    # efsdp = fsdp * tp // ep = 2 * 2 // 4 = 1
    assert shape(exp.meshes["expert"]) == {"pp": 1, "dp_replicate": 2, "efsdp": 1, "ep": 4}
    assert exp.groups("expert:efsdp") == SINGLETONS
    assert exp.groups("expert:ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.kind("expert:fsdp_mesh").mesh_dims == ("dp_replicate", "efsdp")
    assert exp.groups("expert:fsdp_mesh") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_pp_tp_world_8() -> None:
    exp = hf(8, pp_size=2, tp_size=4)
    assert exp.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert exp.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("fsdp") == SINGLETONS
    assert exp.groups("device_mesh") == WORLD
    # ep defaults to 1: the expert mesh has the dense mesh's ranks under other names.
    assert exp.groups("expert:efsdp") == exp.groups("tp")
    assert exp.groups("expert:ep") == SINGLETONS
    # No data_parallel role: accelerate refuses the Trainer's hand-off, so no Trainer loads.
    assert dict(exp.roles) == {"gradient_reduce": "fsdp_mesh", "tensor": "tp", "pipeline": "pp"}


def test_fsdp_only_has_no_trainer_mesh() -> None:
    exp = hf(8, fsdp_size=8)
    assert exp.groups("fsdp") == exp.groups("fsdp_mesh") == WORLD
    assert exp.groups("tp") == SINGLETONS
    assert set(exp.meshes) == {"expert"}
    trainer = {name for name in exp.primary_kinds() if name.startswith("trainer:")}
    assert trainer <= {"trainer:dataloader_replica", "trainer:dataloader_batch_peers"}  # loader


def test_ep_over_the_whole_fsdp_world() -> None:
    exp = hf(8, fsdp_size=8, ep_size=8)
    assert exp.groups("expert:ep") == WORLD
    assert exp.groups("expert:efsdp") == SINGLETONS  # every expert whole on one rank


def test_tp_derived_from_tp_plan_and_world() -> None:
    exp = hf(8, tp_plan="auto", fsdp_size=2)
    assert shape(exp.layout)["tp"] == 4
    assert exp.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert exp.groups("fsdp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_enable_expert_parallel_sets_ep_to_tp() -> None:
    exp = hf(8, tp_size=8, enable_expert_parallel=True)
    assert exp.groups("expert:ep") == exp.groups("tp") == WORLD
    assert exp.groups("expert:efsdp") == SINGLETONS
    explicit = hf(8, tp_size=8, enable_expert_parallel=True, ep_size=1)
    assert explicit.groups("expert:ep") == SINGLETONS  # an explicit ep_size wins


@pytest.mark.parametrize("world", [1, 8])
def test_every_size_one_builds_no_mesh(world: int) -> None:
    exp = hf(world)
    assert exp.kinds() == {}
    assert {"tp", "fsdp_mesh", "expert:ep"} <= set(exp.unavailable())
    assert "returns (None, None)" in str(exp.unavailable()["tp"])


@pytest.mark.parametrize("config", list(refused_configs(8)), ids=str)
def test_refused_configs_raise_the_frameworks_type(config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError) as error:
        hf(8, **config)
    assert error.value.upstream in {"ValueError", "RuntimeError"}


@pytest.mark.parametrize(
    ("config", "upstream", "words"),
    [
        ({"fsdp_size": 0}, "ValueError", "Parallelism sizes must be >= 1"),
        ({"tp_size": 2, "ep_size": 3}, "ValueError", "multiple of `tp_size`"),
        ({"fsdp_size": 4, "tp_size": 2, "ep_size": 16}, "ValueError", "must divide"),
        ({"pp_size": 2, "dp_replicate_size": 4}, "ValueError", "pipeline parallelism"),
        ({"tp_plan": {}, "fsdp_size": 3}, "ValueError", "to derive tp_size"),
        ({"ep_plan": "auto", "tp_size": 8}, "ValueError", "`ep_plan` must be a dictionary"),
        ({"fsdp_size": 4}, "RuntimeError", "requires 4 processes, but world_size is 8"),
        ({"tp_size": 4, "fsdp_size": 4}, "RuntimeError", "requires 16 processes"),
    ],
)
def test_refusal_messages(config: dict[str, Any], upstream: str, words: str) -> None:
    with pytest.raises(LayoutError, match=words) as error:
        hf(8, **config)
    assert error.value.upstream == upstream


def test_refused_configs_are_not_swept() -> None:
    swept = [sorted(c.items(), key=str) for c in configs(8)]
    assert all(sorted(c.items(), key=str) not in swept for c in refused_configs(8))


def test_unknown_key_names_the_close_one() -> None:
    with pytest.raises(LayoutError, match="did you mean 'fsdp_size'"):
        hf(8, fsdp=8)


@pytest.mark.parametrize("world", [8, 16])
def test_efsdp_arithmetic_over_the_sweep(world: int) -> None:
    configs_seen = list(configs(world))
    assert configs_seen and len(configs_seen) < 100
    for config in configs_seen:
        sizes = transformers.resolve(world, config)
        exp = hf(world, **config)
        dense, expert = shape(exp.layout), shape(exp.meshes["expert"])
        assert expert["efsdp"] * expert["ep"] == dense["fsdp"] * dense["tp"], config
        assert expert["efsdp"] == sizes["fsdp_size"] * sizes["tp_size"] // sizes["ep_size"]
        assert (expert["pp"], expert["dp_replicate"]) == (dense["pp"], dense["dp_replicate"])
        # ep groups never leave a (dp_replicate, pp) slice: they tile fsdp x tp ranks.
        for group in exp.groups("expert:ep"):
            assert len({exp.layout.coordinate(r)["dp_replicate"] for r in group}) == 1
        if sizes["ep_size"] == sizes["tp_size"]:  # ep == tp: efsdp is fsdp, same groups
            assert exp.groups("expert:efsdp") == exp.groups("fsdp"), config


def test_million_ranks_answer_fast() -> None:
    exp = hf(2**20, dp_replicate_size=2**10, fsdp_size=2**7, tp_size=8, ep_size=64)
    assert exp.group_of(123_457, "tp") == tuple(range(123_456, 123_464))
    assert exp.meshes["expert"].size_of("efsdp") == 16


# -- the Trainer's accelerate mesh ------------------------------------------------------------
def test_trainer_mesh_is_accelerates_tp_dp_shard() -> None:
    exp = hf(8, fsdp_size=4, tp_size=2, ep_size=4)
    assert shape(exp.meshes["trainer"]) == {"dp_shard": 4, "tp": 2}
    assert exp.groups("trainer:tp") == exp.groups("tp")
    assert exp.groups("trainer:dp_shard") == exp.groups("fsdp")


def test_trainer_folds_hsdp_into_dp_shard() -> None:
    exp = hf(8, dp_replicate_size=2, fsdp_size=2, tp_size=2)
    # The model shards over fsdp (pairs) and replicates over dp_replicate; the Trainer's mesh
    # has one dp_shard dim over both: what the model calls two replicas accelerate calls shards.
    assert shape(exp.meshes["trainer"]) == {"dp_shard": 4, "tp": 2}
    assert exp.groups("trainer:dp_shard") == exp.groups("fsdp_mesh") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("fsdp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert "trainer:dp_replicate" not in exp.kinds()


def test_trainer_refuses_pipeline_parallel_models() -> None:
    exp = hf(8, pp_size=2, tp_size=4)
    assert "trainer" not in exp.meshes
    error = exp.unavailable()["trainer:tp"]
    assert "ParallelismConfig(tp_size=4, dp_shard_size=1)" in str(error)
    assert error.upstream == "ValueError"


# -- the Trainer's loader and TrainingArguments(parallelism_config=...) ----------------------
def test_pipeline_only_model_loads_as_index_r_of_the_world() -> None:
    """``DistributedConfig(pp_size=8)``: no TP, so the released Trainer builds no accelerate
    mesh and ``prepare_data_loader`` makes rank r index r of 8 (not index 0 of 1)."""
    exp = hf(8, pp_size=8)
    assert exp.roles["data_parallel"] == "trainer:dataloader_replica"
    assert exp.groups("data_parallel") == WORLD
    assert "trainer:tp" not in [*exp.kinds(), *exp.unavailable()]  # no mesh, only the loader


def test_a_given_parallelism_config_is_the_trainers_mesh() -> None:
    exp = hf(8, fsdp_size=8, parallelism_config={"dp_shard_size": 8})
    assert exp.groups("trainer:dp_shard") == WORLD
    tp = hf(8, tp_size=2, fsdp_size=4, parallelism_config={"tp_size": 2, "dp_shard_size": 4,
                                                           "cp_backend": "torch"})  # fmt: skip
    assert tp.groups("trainer:tp") == tp.groups("tp")


def test_a_config_whose_sizes_the_trainer_overwrites_is_not_stated() -> None:
    """accelerate's ``build_device_mesh`` reads the sizes ``__post_init__`` stored, not the
    ``tp_size`` / ``dp_shard_size`` the Trainer sets afterwards."""
    exp = hf(8, tp_size=2, fsdp_size=4, parallelism_config={})
    assert "stale" in str(exp.unavailable()["trainer:tp"])
    assert "data_parallel" not in exp.roles


def test_a_refused_backend_key_leaves_the_trainer_unbuilt() -> None:
    exp = hf(8, fsdp_size=8, parallelism_config={"dp_shard_size": 8, "cp_backend": "ring"})
    error = exp.unavailable()["trainer:tp"]
    assert error.upstream == "ValueError" and "cp_backend must be one of" in str(error)
