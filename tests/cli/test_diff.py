"""``meshsim diff``: two conventions or two configs compared role by role, end to end."""

from __future__ import annotations

import numpy as np

from meshsim import expect
from meshsim.cli import config_flags as cf
from meshsim.cli.compare import DIFFERENT, REORDERED, SAME, compare_groups, compare_roles
from meshsim.model.groups import Groups
from tests.cli.helpers import json_of, run_cli
from tests.releases import needs_unflatten

ORDER_EXAMPLE = (
    "diff",
    "megatron",
    "megatron:order=tp-cp-pp-ep-dp",
    "--world-size",
    "16",
    "--tp",
    "2",
    "--pp",
    "2",
)


def _row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_megatron_order_example_shows_which_roles_move() -> None:
    result = run_cli(*ORDER_EXAMPLE)
    assert result.returncode == 1, result.stderr  # like diff(1): 1 when the layouts differ
    out = result.stdout
    assert "configs differ in: order" in out
    assert _row(out, "data_parallel") == [
        "data_parallel",
        "dp",
        "dp",
        "different",
        "16",
        "rank 0: A (0, 2, 4, 6) vs B (0, 4, 8, 12)",
    ]
    assert _row(out, "pipeline")[3:] == ["different", "16", "rank 0: A (0, 8) vs B (0, 2)"]
    assert _row(out, "tensor")[3] == "same"
    assert _row(out, "tp-pp")[1:] == ["different", "16", "rank 0: A (0, 1, 8, 9) vs B (0, 1, 2, 3)"]
    assert "kinds identical in A and B: cp, tp, tp-cp" in out


def test_side_flags_are_equivalent() -> None:
    spec = json_of(run_cli(*ORDER_EXAMPLE, "--json"))
    flags = json_of(
        run_cli(
            "diff",
            "megatron",
            "megatron",
            "-n",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--b-order",
            "tp-cp-pp-ep-dp",
            "--json",
        )
    )
    assert spec == flags
    assert spec["differ"] is True
    assert spec["b"]["config"]["order"] == "tp-cp-pp-ep-dp"
    roles = {c["name"]: c for c in spec["roles"]}
    assert roles["data_parallel"]["example"] == {"rank": 0, "a": [0, 2, 4, 6], "b": [0, 4, 8, 12]}
    assert roles["tensor"]["verdict"] == SAME


def test_megatron_deepspeed_equals_megatron_tp_dp_pp() -> None:
    result = run_cli(
        "diff",
        "megatron",
        "megatron-deepspeed",
        "-n",
        "16",
        "--tensor-model-parallel-size",
        "2",
        "--pp",
        "2",
        "--set",
        "order=tp-dp-pp",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "A and B put the same ranks together for all 7 shared roles" in result.stdout
    assert _row(result.stdout, "gradient_reduce")[1:4] == ["dp-cp", "seq_dp", "same"]


@needs_unflatten
def test_olmo_core_vs_torchtitan_hsdp_cp() -> None:
    data = json_of(
        run_cli(
            "diff",
            "olmo-core",
            "torchtitan",
            "-n",
            "16",
            "--dp-replicate",
            "2",
            "--cp",
            "2",
            "--json",
        )
    )
    assert data["a"]["config"] == {"dp": "hsdp", "num_replicas": 2, "cp": 2}
    assert data["b"]["config"]["dp_replicate"] == 2 and data["b"]["config"]["dp_shard"] == 4
    roles = {c["name"]: c for c in data["roles"]}
    assert roles["data_parallel"]["kind_a"] == "get_dp_process_group"
    assert roles["context"]["verdict"] == SAME


def test_translation_table() -> None:
    assert cf.translate("megatron", 16, {"tp": 2, "pp": 4}) == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 4,
    }
    assert cf.translate("deepspeed", 16, {"tp": 2, "pp": 2, "dp": 4}) == {
        "num_mp": 2,
        "num_pp": 2,
        "num_dp": 4,
    }
    assert cf.translate("megatron-deepspeed", 8, {"cp": 4}) == {"sequence_parallel_size": 4}
    assert cf.translate("olmo-core", 8, {"tp": 2}) == {"tp": 2, "dp": "fsdp"}
    assert cf.translate("olmo-core", 8, {"ep": 4}) == {"ep": 4, "dp": "hsdp", "shard_degree": 4}
    assert cf.translate("torchtitan", 8, {"dp_shard": 4, "tp": 2}) == {"dp_shard": 4, "tp": 2}
    assert cf.translate("torch", 8, {"tp": 2})["mesh_shape"] == (1, 4, 1, 2)


def test_compare_groups_verdicts() -> None:
    a = Groups([(0, 1), (2, 3)])
    assert compare_groups(a, Groups([(2, 3), (0, 1)]), 4) == (SAME, 0, None)
    assert compare_groups(a, Groups([(1, 0), (2, 3)]), 4) == (REORDERED, 2, 0)
    assert compare_groups(a, Groups([(0, 2), (1, 3)]), 4) == (DIFFERENT, 4, 0)
    assert compare_groups(a, Groups([(0, 1, 2, 3)]), 4) == (DIFFERENT, 4, 0)
    # ranks in no group on either side compare equal (embedding groups skip middle stages)
    assert compare_groups(Groups([(0, 3)]), Groups([(0, 3)]), 4)[0] == SAME


def test_compare_roles_is_vectorised_at_scale() -> None:
    world = 1 << 16
    a = expect("megatron", world, tensor_model_parallel_size=8, pipeline_model_parallel_size=8)
    b = expect(
        "megatron",
        world,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=8,
        order="tp-cp-pp-ep-dp",
    )
    roles = {c.name: c for c in compare_roles(a, b)}
    assert roles["tensor"].verdict == SAME
    assert roles["data_parallel"].verdict == DIFFERENT
    assert roles["data_parallel"].ranks == world
    assert np.int64(roles["pipeline"].example[0]) == 0
