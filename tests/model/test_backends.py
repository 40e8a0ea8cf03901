"""The backend each kind's groups must have: megatron's gloo twins, torchtitan's fake size-1
axes, ``init_device_mesh(backend_override=...)``; everything else is the world's backend."""

from __future__ import annotations

from meshsim import expect


def test_megatron_gloo_twins_are_gloo_and_the_rest_the_worlds() -> None:
    exp = expect("megatron", 8, tensor_model_parallel_size=2)
    for name in ("dp:gloo", "dp-cp:gloo"):
        assert exp.kind(name).backends_on("nccl", 1) == ("gloo",)
    assert exp.kind("dp").backends_on("nccl", 1) == ("nccl",)
    assert exp.kind("dp-cp:ag").backends_on("nccl", 1) == ("nccl",)


def test_torch_backend_override_names_the_dim_and_keeps_it_in_slices() -> None:
    exp = expect(
        "torch",
        8,
        mesh_shape=(2, 2, 2),
        mesh_dim_names=("dp", "cp", "tp"),
        backend_override={"tp": "fake", 0: "gloo"},
        ops=["flatten dp,cp -> dp_cp"],
    )
    assert exp.kind("tp").backends_on("nccl", 1) == ("fake",)
    assert exp.kind("dp").backends_on("nccl", 1) == ("gloo",)
    assert exp.kind("cp").backends_on("nccl", 1) == ("nccl",)
    assert exp.kind("dp_cp").backends_on("nccl", 1) == ("nccl",)  # _flatten takes no override


def test_torchtitan_fakes_exactly_the_axes_it_counts_as_off() -> None:
    """tp 2, dp_shard 4 at world 8 (spmd_types): pp, cp, dp_replicate, ep and efsdp are off;
    dp_shard is the storage axis, real even at size 1; loss_mesh comes from ``_flatten``."""
    exp = expect("torchtitan", 8, tp=2, dp_shard=4)
    singleton = "include_singleton_axes=True"
    assert exp.kind(f"get_optional_mesh(pp, {singleton})").backends_on("gloo", 1) == ("fake",)
    assert exp.kind(f"get_optional_mesh(tp, {singleton})").backends_on("gloo", 1) == ("gloo",)
    assert exp.kind("dense[dp_replicate]").backends_on("gloo", 1) == ("fake",)
    assert exp.kind("sparse[efsdp]").backends_on("gloo", 1) == ("fake",)
    assert exp.kind("loss[loss_mesh]").backends_on("gloo", 1) == ("gloo",)
    both = exp.kind(f"get_optional_mesh([pp, tp], {singleton})")
    assert both.backends_on("gloo", 2) == ("fake", "gloo")
    one_dp_shard = expect("torchtitan", 8, tp=8, dp_shard=1)
    assert one_dp_shard.kind("dense[dp_shard]").backends_on("gloo", 1) == ("gloo",)
    partial = expect("torchtitan", 8, tp=8, dp_shard=1, spmd_backend="partial_dtensor")
    assert partial.kind("dense[fsdp]").backends_on("gloo", 1) == ("gloo",)  # fsdp: always real


def test_a_kind_observed_with_another_number_of_dims_defaults_to_the_world() -> None:
    exp = expect("megatron", 8, tensor_model_parallel_size=2)
    assert exp.kind("dp:gloo").backends_on("nccl", 2) == ("nccl", "nccl")
