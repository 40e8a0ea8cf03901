"""accelerate's own ParallelismConfig, mesh, validation and data loader, on gloo, against meshsim's
reference. Runs against whichever accelerate is installed (1.15 or 1.10): each config names that
release (``version``); a release-specific case skips on the other."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from typing import Any

import pytest

from meshsim import expect
from meshsim.errors import LayoutError
from tests.real._helpers import (
    assert_matches,
    assert_refused_alike,
    case_id,
    real_outcomes,
    require,
)

pytestmark = [require("accelerate", "accelerate"), pytest.mark.requires_framework("accelerate")]

INSTALLED = (
    ".".join(version("accelerate").split(".")[:2])
    if importlib.util.find_spec("accelerate")
    else "none"
)
only_115 = pytest.mark.skipif(INSTALLED != "1.15", reason=f"accelerate {INSTALLED}: 1.15 only")
only_110 = pytest.mark.skipif(INSTALLED != "1.10", reason=f"accelerate {INSTALLED}: 1.10 only")


def here(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the installed release (the adapter runs that one only)."""
    return {**config, "version": INSTALLED}


WORLD_4: list[dict[str, Any]] = [
    {},  # no mesh: every kind a TypeError, loader keeps process_index
    {"dp_shard_size": 4},
    {"dp_shard_size": 2, "tp_size": 2},
    {"dp_shard_size": 2, "cp_size": 2},
    {"dp_replicate_size": 2, "dp_shard_size": 2},
    {"dp_replicate_size": 4},  # DDP: no dp_shard_cp
    {"tp_size": 4},
    {"cp_size": 4},
    {"autotp_size": 2},  # DeepSpeed AutoTP: a ("tp",) mesh on ranks 0, 1
    {"dp_shard_size": 2, "tp_size": 2, "distributed_type": "MULTI_GPU"},
    {"dp_shard_size": 2, "tp_size": 2, "dispatch_batches": True},  # one batch for every rank
    {"dp_shard_size": 2, "cp_size": 2, "dispatch_batches": True},  # a slice each, CP peers too
]
WORLD_8: list[dict[str, Any]] = [
    {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
    {"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2},
    {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
    {"autotp_size": 4},
]
REFUSED_4: list[dict[str, Any]] = [
    {"tp_size": 0},
    {"dp_replicate_size": 2, "tp_size": 2},
    {"cp_size": 4, "distributed_type": "MULTI_GPU"},  # replayed AcceleratorState check
    {"dp_shard_size": 3},  # mesh built on ranks 0-2, then _validate_accelerator refuses
    {"tp_size": 8},  # init_device_mesh refuses
    {"autotp_size": 8},
]


@pytest.mark.parametrize("config", WORLD_4, ids=case_id)
def test_world_4_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("accelerate", 4, here(config))


@pytest.mark.parametrize("config", WORLD_8, ids=case_id)
def test_world_8_matches_reference(config: dict[str, Any]) -> None:
    assert_matches("accelerate", 8, here(config))


@pytest.mark.parametrize("config", REFUSED_4, ids=case_id)
def test_refusals_match_reference(config: dict[str, Any]) -> None:
    assert_refused_alike("accelerate", 4, here(config))


def test_loader_data_is_the_mesh_dp() -> None:
    """Observed from the batches accelerate's own sampler yields: the ranks loading different
    batches are the mesh's ``dp``, the ranks loading the same ones a ``cp`` group."""
    fsdp = assert_matches("accelerate", 4, here({"dp_shard_size": 2, "cp_size": 2}))
    rank1 = fsdp[1].groups
    assert rank1["dataloader_replica"].members == rank1["dp"].members == (1, 3)
    assert rank1["dataloader_batch_peers"].members == rank1["cp"].members == (0, 1)


@only_115
def test_115_deepspeed_loader_ignores_cp() -> None:
    """``prepare_data_loader``'s DeepSpeed branch divides by tp only: CP peers load different
    batches (1.10 refuses DeepSpeed with a ParallelismConfig, see test_110_refusals)."""
    ds = assert_matches(
        "accelerate", 4, here({"dp_shard_size": 2, "cp_size": 2, "distributed_type": "DEEPSPEED"})
    )
    assert ds[1].groups["cp"].members == (0, 1)
    assert ds[1].groups["dataloader_replica"].members == (0, 1, 2, 3)
    assert ds[1].groups["dataloader_batch_peers"].members == (1,)


@only_115
def test_115_refuses_fsdp_with_nothing_to_shard() -> None:
    message = assert_refused_alike(
        "accelerate", 4, here({"tp_size": 4, "distributed_type": "FSDP"})
    )
    assert "no dimension for FSDP to shard" in message


@only_115
def test_115_deepspeed_sp_builds_no_mesh() -> None:
    assert_matches("accelerate", 4, here({"sp_size": 2}))


@only_110
def test_110_tp_only_fsdp_mesh_raises_key_error() -> None:
    """accelerate#3798: 1.10 accepts it, and ``mesh[("dp_shard_cp",)]`` raises KeyError."""
    config = here({"tp_size": 4, "distributed_type": "FSDP"})
    observations = assert_matches("accelerate", 4, config)
    assert all("fsdp_mesh" in o.absent for o in observations)


@only_110
@pytest.mark.parametrize(
    "config", [{"sp_size": 2}, {"dp_shard_size": 4, "distributed_type": "DEEPSPEED"}], ids=case_id
)
def test_110_refusals(config: dict[str, Any]) -> None:
    assert_refused_alike("accelerate", 4, here(config))


def test_other_release_is_refused_as_usage() -> None:
    other = "1.10" if INSTALLED == "1.15" else "1.15"
    expect("accelerate", 4, dp_shard_size=4, version=other)  # the reference models it
    outcomes = real_outcomes("accelerate", 4, {"dp_shard_size": 4, "version": other})
    assert {o[:2] for o in outcomes} == {("refused", "UsageError")}
    assert f"accelerate {INSTALLED} is installed" in outcomes[0][3]
    with pytest.raises(LayoutError):
        expect("accelerate", 4, dp_shard_size=3, version=other)


def _deepspeed_tp_groups(autotp: int) -> str | tuple[int, ...]:
    """DeepSpeed's own ``_init_tp_mesh_device`` on this rank (what its engine calls for AutoTP
    after accelerate's ``_prepare_deepspeed``): this rank's TP group, or the error's type."""
    import torch.distributed as dist

    from meshsim.builders.real import _shims

    (groups,) = _shims.load("deepspeed.utils.groups")
    with _shims.deepspeed_comm():
        groups._release_process_group_references(None)
        try:
            groups._init_tp_mesh_device(tensor_model_parallel_size=autotp)
            return tuple(dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()))
        except Exception as error:
            return type(error).__name__
        finally:
            groups._release_process_group_references(None)


@pytest.mark.requires_framework("deepspeed")
def test_non_dividing_autotp_fails_in_deepspeeds_engine_as_the_reference_says() -> None:
    """The reference's IndexError for autotp_size 3 on 8 ranks is DeepSpeed 0.19.8's: its
    engine's ``_init_tp_mesh_device`` lays a (2, 3) mesh over ranks 0-5, and ranks 6 and 7 fail.
    (The adapter stops at accelerate's mesh, so this runs DeepSpeed's function itself.)"""
    pytest.importorskip("deepspeed.utils.groups")
    from meshsim import run

    with pytest.raises(LayoutError) as refused:
        expect("accelerate", 8, autotp_size=3)
    assert refused.value.upstream == "IndexError"
    got = list(run(_deepspeed_tp_groups, 8, backend="gloo", timeout=120, args=(3,)))
    assert got[:6] == [(0, 1, 2), (0, 1, 2), (0, 1, 2), (3, 4, 5), (3, 4, 5), (3, 4, 5)]
    assert got[6:] == ["IndexError", "IndexError"]


@only_115
@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("config", [{"sp_size": 2}, {"sp_size": 4}], ids=case_id)
def test_115_deepspeed_ulysses_groups_are_deepspeeds(config: dict[str, Any]) -> None:
    """``ds:sp`` / ``ds:sp_dp`` from DeepSpeed's own ``initialize_sequence_parallel``."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    observed = assert_matches("accelerate", 4, here(config))
    sp = config["sp_size"]
    assert observed[1].groups["ds:sp"].members == tuple(range(sp))
    assert observed[1].groups["ds:sp_dp"].members == (0, 1, 2, 3)


@only_115
@pytest.mark.requires_framework("deepspeed")
@pytest.mark.parametrize("config", [{"sp_size": 3}, {"sp_size": 8}], ids=case_id)
def test_115_deepspeed_refuses_an_ulysses_degree_the_world_cannot_take(
    config: dict[str, Any],
) -> None:
    pytest.importorskip("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    assert "sequence_parallel_size" in assert_refused_alike("accelerate", 4, here(config))


@only_115
def test_115_backend_keys_change_nothing_and_others_are_refused_alike() -> None:
    """``cp_backend`` / ``sp_backend`` accept one value each (their defaults): the groups and
    the loader are those of the sizes alone; any other value is ``__post_init__``'s ValueError."""
    sizes = {"dp_shard_size": 2, "cp_size": 2}
    named = assert_matches(
        "accelerate", 4, here({**sizes, "cp_backend": "torch", "sp_backend": "deepspeed"})
    )
    plain = assert_matches("accelerate", 4, here(sizes))
    assert [o.groups for o in named] == [o.groups for o in plain]
    for bad in ({"cp_backend": "ring"}, {"sp_backend": "megatron"}):
        assert "must be one of" in assert_refused_alike("accelerate", 4, here({**sizes, **bad}))
