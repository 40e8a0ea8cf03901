"""accelerate convention: the kept dims, the three flattens, the loader's arithmetic, refusals."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import meshsim
from meshsim import LayoutError
from meshsim.model.conventions import accelerate
from meshsim.model.invariants import find_violations
from tests.model._tt_olmo_helpers import assert_invariants

WORLD = tuple(range(8))
FLAT_NAMES = ("dp", "dp_shard_cp", "dp_cp")


def acc(world: int, **config: Any) -> meshsim.Expected:
    return meshsim.expect("accelerate", world, **config)


def dims(exp: meshsim.Expected) -> dict[str, int]:
    assert exp.layout is not None
    return dict(zip(exp.layout.root_names, exp.layout.root_shape, strict=True))


# -- hand-checked rank lists, world 8 -------------------------------------------------------------
def test_fsdp_tp_keeps_two_dims_and_flattens_dp_alone() -> None:
    exp = acc(8, dp_shard_size=4, tp_size=2)
    assert dims(exp) == {"dp_shard": 4, "tp": 2}
    assert exp.config["distributed_type"] == "FSDP"
    shard = [(0, 2, 4, 6), (1, 3, 5, 7)]
    for kind in ("dp_shard", "dp", "dp_shard_cp", "dp_cp", "fsdp_mesh", "dataloader_replica"):
        assert exp.groups(kind) == shard, kind
    assert exp.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("dataloader_batch_peers") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert set(exp.unavailable()) == {"dp_replicate", "cp", "sp"}
    assert exp.unavailable()["cp"].upstream == "KeyError"
    assert dict(exp.roles) == {
        "data_parallel": "dataloader_replica",
        "gradient_reduce": "fsdp_mesh",
        "tensor": "tp",
    }


def test_hsdp_cp_tp_every_flatten() -> None:
    exp = acc(16, dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert dims(exp) == {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}
    assert exp.groups("dp_replicate")[0] == (0, 8)
    assert exp.groups("dp_shard")[0] == (0, 4)
    assert exp.groups("cp")[0] == (0, 2)
    assert exp.groups("dp")[0] == (0, 4, 8, 12)  # (dp_replicate, dp_shard)
    assert list(exp.groups("dp_shard_cp"))[:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("dp_cp")[0] == (0, 2, 4, 6, 8, 10, 12, 14)
    fsdp = exp.kind("fsdp_mesh")  # 2-D (dp_replicate, dp_shard_cp): one group of 8
    assert fsdp.mesh_dims == ("dp_replicate", "dp_shard_cp") and fsdp.mesh_shape == (2, 4)
    assert exp.groups("fsdp_mesh")[0] == (0, 2, 4, 6, 8, 10, 12, 14)
    # the loader divides by tp * cp = 4: ranks 0-3 load the same batches
    assert exp.groups("dataloader_batch_peers")[0] == (0, 1, 2, 3)
    assert exp.groups("dataloader_replica") == exp.groups("dp")
    assert exp.roles["context"] == "cp"


def test_size_one_dims_are_dropped_not_kept() -> None:
    exp = acc(8, dp_replicate_size=1, dp_shard_size=8, tp_size=1, cp_size=1)
    assert dims(exp) == {"dp_shard": 8}
    assert exp.groups("dp") == exp.groups("dp_shard") == [WORLD]


def test_ddp_only_dp_replicate_has_no_dp_shard_cp() -> None:
    exp = acc(8, dp_replicate_size=8)
    assert exp.config["distributed_type"] == "MULTI_GPU"
    assert exp.groups("dp") == exp.groups("dp_cp") == exp.groups("ddp") == [WORLD]
    assert exp.unavailable()["dp_shard_cp"].upstream == "KeyError"
    assert exp.roles["gradient_reduce"] == "ddp"
    assert exp.groups("dataloader_replica") == [WORLD]


def test_every_size_one_builds_no_mesh() -> None:
    exp = acc(8)
    assert exp.layout is None
    for name in (*accelerate.MESH_ORDER, *FLAT_NAMES):
        assert exp.unavailable()[name].upstream == "TypeError"  # torch_device_mesh is None
    # no mesh: the loader keeps process_index, every rank its own batches (DDP over the world)
    assert exp.groups("dataloader_replica") == [WORLD]
    assert exp.groups("dataloader_batch_peers") == [(r,) for r in WORLD]
    assert exp.groups("ddp") == [WORLD]


def test_tp_only_is_accelerate_3798_in_1_10() -> None:
    """accelerate#3798: a TP-only mesh has no dp_shard_cp; FSDP2's mesh[fsdp_dim_names] raises."""
    exp = acc(8, tp_size=8, distributed_type="FSDP", version="1.10")
    assert dims(exp) == {"tp": 8}
    assert exp.unavailable()["fsdp_mesh"].upstream == "KeyError"
    assert "dp_shard_cp" in str(exp.unavailable()["fsdp_mesh"])
    assert "gradient_reduce" not in exp.roles
    assert "accelerate#3798" in exp.unknown_roles["gradient_reduce"]  # raises: nothing reduces
    replicated = acc(8, dp_replicate_size=8, distributed_type="FSDP", version="1.10")
    assert "KeyError" in replicated.unknown_roles["gradient_reduce"]
    assert find_violations(replicated) == []  # accelerate raises; no replica trains silently
    with pytest.raises(LayoutError, match="no dimension for FSDP to shard") as refused:
        acc(8, tp_size=8, distributed_type="FSDP")  # 1.15 refuses up front
    assert refused.value.upstream == "ValueError"


def test_tp_only_without_fsdp_is_accepted_in_both() -> None:
    for version in accelerate.VERSIONS:
        exp = acc(8, tp_size=8, version=version)
        assert exp.groups("tp") == [WORLD]
        assert exp.groups("dataloader_batch_peers") == [WORLD]  # one batch stream for all
        assert "gradient_reduce" not in exp.roles and "ddp" not in exp.kinds()
        assert not exp.unknown_roles  # no DDP, and with one replica none is needed


def test_multi_gpu_with_tp_wraps_no_ddp_around_its_replicas() -> None:
    """``prepare_model`` wraps DDP only when ``tp_enabled`` is false (1.10 and 1.15 alike), and
    ``_validate_accelerator`` accepts dp_shard > 1 next to TP under MULTI_GPU: the loader splits
    batches over the dp_shard replicas, whose gradients nothing reduces (docs/findings.md)."""
    for version in accelerate.VERSIONS:
        exp = acc(8, dp_shard_size=2, tp_size=4, distributed_type="MULTI_GPU", version=version)
        assert "gradient_reduce" not in exp.roles and not exp.unknown_roles
        assert exp.groups("dataloader_replica") == [(0, 4), (1, 5), (2, 6), (3, 7)]
        assert {v.check for v in find_violations(exp)} == {"gradient_reduce ⊇ data_parallel"}


def test_deepspeed_autotp_mesh_is_smaller_than_the_world() -> None:
    exp = acc(8, autotp_size=2)
    kind = exp.kind("ds:tp")
    assert exp.groups("ds:tp") == [(0, 1)] and not kind.partition
    assert kind.group_of(5) is None  # ranks 2..7 hold no group of accelerate's AutoTP mesh
    assert exp.groups("dataloader_batch_peers") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("dataloader_replica") == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_deepspeed_sp_builds_no_mesh_in_1_15() -> None:
    exp = acc(8, sp_size=4)
    assert exp.config["distributed_type"] == "DEEPSPEED"
    assert "gradient_reduce" in exp.unknown_roles  # DeepSpeed's engine picks its own group
    assert exp.layout is None  # DeepSpeed builds its own SP groups
    assert exp.unavailable()["sp"].upstream == "TypeError"
    assert exp.groups("dataloader_replica") == [WORLD]  # the Ulysses adapter regroups later


# -- the loader's arithmetic against the mesh's dp ------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16])
def test_loader_replica_is_the_mesh_dp_outside_deepspeed(world: int) -> None:
    """``process_index // (tp * cp)`` is the mesh's ``dp`` rank wherever accelerate builds a dp
    and shards batches (no dispatcher): tp, cp (and sp) follow dp_replicate, dp_shard."""
    compared = 0
    for config in accelerate.configs(world):
        exp = acc(world, **config)
        if exp.config["distributed_type"] == "DEEPSPEED" or "dp" not in exp.kinds():
            continue
        if config.get("dispatch_batches"):
            continue
        assert exp.groups("dataloader_replica") == exp.groups("dp"), config
        compared += 1
    assert compared or world == 1


def test_deepspeed_loader_ignores_cp() -> None:
    """``prepare_data_loader``'s DeepSpeed branch divides by tp only: with cp > 1 the CP peers,
    which must see one sequence, load different batches; the mesh's dp is not the loader's."""
    exp = acc(8, dp_shard_size=4, cp_size=2, distributed_type="DEEPSPEED")
    assert exp.groups("cp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert exp.groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert exp.groups("dataloader_replica") == [WORLD]  # process_index // 1
    assert exp.groups("dataloader_replica") != exp.groups("dp")
    with pytest.raises(LayoutError, match="context peers share the data-parallel rank"):
        assert_invariants(exp)
    fsdp = acc(8, dp_shard_size=4, cp_size=2)  # the same sizes under FSDP: the loader agrees
    assert fsdp.groups("dataloader_replica") == fsdp.groups("dp")


def test_dispatcher_with_tp_feeds_every_dp_rank_the_same_batch() -> None:
    """``DataLoaderDispatcher`` replicates rank 0's batch to every rank once the mesh has ``tp``;
    its "TP + (DP/FSDP) is not yet supported in dispatch mode" guard looks for dims named
    ``dp``/``fsdp``, which accelerate's mesh never has, so FSDP ranks silently train on
    identical data."""
    exp = acc(8, dp_shard_size=4, tp_size=2, dispatch_batches=True)
    assert exp.groups("dataloader_batch_peers") == [WORLD]
    assert exp.groups("dataloader_replica") == [(r,) for r in WORLD]
    assert exp.groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]  # 4 DP ranks, one batch stream
    with pytest.raises(LayoutError, match="gradient-reduce peers load different batches"):
        assert_invariants(exp)  # the FSDP peers average gradients of one batch
    cp = acc(8, dp_shard_size=4, cp_size=2, dispatch_batches=True)  # no tp: a slice each, cp too
    assert cp.groups("dataloader_replica") == [WORLD]
    with pytest.raises(LayoutError, match="context peers share the data-parallel rank"):
        assert_invariants(cp)


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "upstream", "match"),
    [
        ({"tp_size": 0}, "ValueError", "tp_size must be at least 1"),
        ({"dp_replicate_size": 2, "tp_size": 4}, "ValueError", "pure data parallelism"),
        ({"dp_replicate_size": 2, "cp_size": 4}, "ValueError", "pure data parallelism"),
        ({"cp_size": 2, "sp_size": 4}, "ValueError", "mutually exclusive"),
        ({"cp_size": 8, "distributed_type": "MULTI_GPU"}, "ValueError", "fsdp_plugin"),
        ({"dp_shard_size": 4}, "ValueError", r"total_size \(4\) does not match"),
        ({"dp_shard_size": 16}, "RuntimeError", "bigger than default world size"),
        ({"dp_replicate_size": 8, "distributed_type": "FSDP"}, "ValueError", "FSDP to shard"),
        ({"autotp_size": 16}, "RuntimeError", "init_device_mesh"),
        ({"autotp_size": 3}, "IndexError", r"raises IndexError on ranks 6-7"),
        ({"sp_size": 2, "version": "1.10"}, "TypeError", "unexpected keyword argument 'sp_size'"),
        ({"dp_shard_size": 8, "distributed_type": "DEEPSPEED", "version": "1.10"}, "ValueError",
         "only compatible"),
    ],
)  # fmt: skip
def test_refusals_name_the_exception(config: dict[str, Any], upstream: str, match: str) -> None:
    with pytest.raises(LayoutError, match=match) as refused:
        acc(8, **config)
    assert refused.value.upstream == upstream


def test_refused_configs_are_refused_and_configs_accepted() -> None:
    for world in (2, 4, 8):
        refused = list(accelerate.refused_configs(world))
        for config in refused:
            with pytest.raises(LayoutError) as error:
                acc(world, **config)
            assert error.value.upstream, (world, config)
        for config in accelerate.configs(world):
            assert config not in refused
    assert len(list(accelerate.configs(8))) <= 100


def test_meshsim_usage_errors_have_no_upstream() -> None:
    for config in ({"version": "2.0"}, {"autotp_size": 2, "distributed_type": "FSDP"},
                   {"tp_size": 2.0}, {"distributed_type": "TPU"}):  # fmt: skip
        with pytest.raises(LayoutError) as error:
            acc(8, **config)
        assert error.value.upstream is None, config
    with pytest.raises(LayoutError, match="did you mean 'tp_size'"):
        acc(8, tp_sise=2)


# -- 1.10 against 1.15 -----------------------------------------------------------------------------
def test_versions_differ_only_in_refusals() -> None:
    """Every config both releases accept builds the same groups; 1.10 accepts FSDP with nothing
    to shard (then fails in fully_shard), refuses DeepSpeed with a ParallelismConfig and sp."""
    only_110, only_115 = [], []
    for config in accelerate.configs(8, versions=("1.15",)):
        new = acc(8, **config)
        try:
            old = acc(8, **config, version="1.10")
        except LayoutError as error:
            only_115.append((config, error.upstream))
            continue
        for name in new.kinds():
            assert old.groups(name) == new.groups(name), (config, name)
        assert set(old.unavailable()) == set(new.unavailable())
    for config in accelerate.configs(8, versions=("1.10",)):
        if config.get("version") == "1.10":
            only_110.append(config)
    assert {u for _, u in only_115} == {"TypeError", "ValueError"}
    assert all(c.get("distributed_type") == "DEEPSPEED" or "sp_size" in c for c, _ in only_115)
    assert only_110 == [
        {"tp_size": 8, "distributed_type": "FSDP", "version": "1.10"},
        {"dp_replicate_size": 8, "distributed_type": "FSDP", "version": "1.10"},
    ]


def test_version_spellings() -> None:
    assert acc(8, tp_size=8, version=1.1).config["version"] == "1.10"  # the CLI's float
    assert acc(8, tp_size=8, version="1.15.0").config["version"] == "1.15"


# -- properties -----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12])
def test_invariants_hold_outside_the_deepspeed_cp_finding(world: int) -> None:
    """Every config keeps every invariant except accelerate's findings (docs/findings.md):
    DeepSpeed (or the dispatcher) with cp; the dispatcher with TP + FSDP, whose one batch for
    every rank breaks exactly ``gradient-reduce peers load different batches``; and MULTI_GPU
    with TP and data parallelism, which wraps no DDP and breaks exactly
    ``gradient_reduce ⊇ data_parallel``."""
    for config in accelerate.configs(world):
        exp = acc(world, **config)
        ignores_cp = exp.config["distributed_type"] == "DEEPSPEED" or config.get("dispatch_batches")
        if ignores_cp and exp.config["cp_size"] > 1:
            continue  # test_deepspeed_loader_ignores_cp, test_dispatcher_with_tp_...
        found = {v.check for v in find_violations(exp)}
        if config.get("dispatch_batches") and exp.config["tp_size"] > 1:
            assert found == {"gradient-reduce peers load different batches"}, config
            continue
        replicas = exp.groups("dataloader_replica").group_size
        if exp.config["distributed_type"] == "MULTI_GPU" and exp.config["tp_size"] > 1:
            assert found == ({"gradient_reduce ⊇ data_parallel"} if replicas > 1 else set())
            continue
        assert_invariants(exp)


def test_a_million_ranks_and_no_torch_import() -> None:
    exp = acc(2**20, dp_replicate_size=2**4, dp_shard_size=2**6, cp_size=2**4, tp_size=2**6)
    assert exp.group_of(2**20 - 1, "tp") == tuple(range(2**20 - 2**6, 2**20))
    assert exp.group_of(0, "dataloader_replica") == tuple(range(0, 2**20, 2**10))
    code = (
        "import sys; from meshsim.model.conventions import accelerate; "
        "accelerate.expect(8, tp_size=8); "
        "print('torch' in sys.modules, 'accelerate' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
