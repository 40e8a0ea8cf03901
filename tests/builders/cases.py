"""Representative configs per convention: CP, HSDP, EP, PP, odd orders, size-1 dims, rejections."""

from __future__ import annotations

from typing import Any

Case = tuple[str, int, dict[str, Any]]


def _text(value: Any) -> str:
    """Stable text for an id: functions by name (their repr holds an address)."""
    return getattr(value, "__name__", None) or str(value) if callable(value) else str(value)


def _ids(cases: list[Case]) -> list[str]:
    return [
        f"{fw}-{world}-" + ",".join(f"{k}={_text(v)}" for k, v in cfg.items())
        for fw, world, cfg in cases
    ]


TORCH: list[Case] = [
    (
        "torch",
        8,
        {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp", "cp", "tp"), "ops": ["flatten dp,cp"]},
    ),
    (
        "torch",
        8,
        {
            "mesh_shape": (2, 2, 2),
            "mesh_dim_names": ("dp", "cp", "tp"),
            "ops": ["flatten dp,tp -> x"],
        },
    ),
    (
        "torch",
        8,
        {
            "ops": [
                "unflatten world 2,4 -> dp,tp",
                "unflatten world 2,2,2 -> a,b,c",
                "flatten a,c -> ac",
            ]
        },
    ),
    ("torch", 4, {"mesh": [[0, 2], [1, 3]], "mesh_dim_names": ("dp", "tp")}),
    ("torch", 6, {"mesh_shape": (3, 2), "mesh_dim_names": ("pp", "tp")}),
]

OLMO: list[Case] = [
    ("olmo-core", 8, {}),
    ("olmo-core", 8, {"dp": "ddp", "tp": 2}),
    ("olmo-core", 8, {"dp": "fsdp", "cp": 2, "tp": 2}),
    ("olmo-core", 8, {"dp": "fsdp", "cp": 1, "tp": 1}),  # present size-1 dims
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 2}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 2, "cp": 2}),  # get_dp_shard_mesh raises
    ("olmo-core", 16, {"dp": "hsdp", "shard_degree": 2, "cp": 2, "tp": 2, "pp": 2}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 2, "ep": 4}),
    ("olmo-core", 8, {"dp": "hsdp", "num_nodes": 2, "ep": -1, "pp": 2}),
    ("olmo-core", 8, {"dp": "fsdp", "pp": 4}),
    ("olmo-core", 8, {"expert_mesh_ep": 4}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 4, "expert_mesh_ep": -1}),
]

TORCHTITAN: list[Case] = [
    ("torchtitan", 8, {}),
    ("torchtitan", 8, {"tp": 2}),
    ("torchtitan", 16, {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}),
    ("torchtitan", 16, {"pp": 2, "dp_shard": 4, "tp": 2, "ep": 4}),
    ("torchtitan", 8, {"dp_replicate": 2, "cp": 2, "tp": 2, "spmd_backend": "partial_dtensor"}),
    ("torchtitan", 4, {"tp": 4, "spmd_backend": "full_dtensor"}),  # dp_shard real at size 1
    (
        "torchtitan",
        16,
        {"pp": 2, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 4, "spmd_backend": "full_dtensor"},
    ),
    ("torchtitan", 8, {"version": "intermediate", "dp_shard": 4, "tp": 2, "ep": 2, "etp": 2}),
    ("torchtitan", 8, {"version": "intermediate", "dp_shard": 4, "tp": 2, "ep": 4, "etp": 1}),
    ("torchtitan", 8, {"version": "legacy", "dp_shard": 4, "tp": 2, "ep": 4, "etp": 1}),
    (
        "torchtitan",
        16,
        {
            "version": "legacy",
            "dp_replicate": 2,
            "dp_shard": 2,
            "cp": 2,
            "tp": 2,
            "ep": 4,
            "etp": 2,
        },
    ),
    ("torchtitan", 8, {"version": "legacy", "pp": 2, "dp_replicate": 2, "cp": 2}),
    ("torchtitan", 8, {"version": "hyper_parallel", "dp_shard": 2, "ep": 2, "cp": 2}),
    ("torchtitan", 8, {"version": "hyper_parallel", "dp_replicate": 2, "tp": 4}),
    ("torchtitan", 4, {"version": "hyper_parallel", "cp": 4}),
]

MEGATRON: list[Case] = [
    ("megatron", 8, {}),
    ("megatron", 16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4}),
    (
        "megatron",
        16,
        {
            "tensor_model_parallel_size": 2,
            "context_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
        },
    ),
    (
        "megatron",
        16,
        {
            "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 1,
            "pipeline_model_parallel_size": 2,
        },
    ),
    (
        "megatron",
        16,
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "order": "tp-pp-dp"},
    ),
    (
        "megatron",
        16,
        {
            "tensor_model_parallel_size": 2,
            "context_parallel_size": 2,
            "order": "dp-cp-tp-pp",
            "pipeline_model_parallel_size": 2,
        },
    ),
    ("megatron", 8, {"tensor_model_parallel_size": 2, "order": "pp-dp-tp"}),
    (
        "megatron",
        16,
        {
            "context_parallel_size": 4,
            "hierarchical_context_parallel_sizes": [2, 2],
            "num_distributed_optimizer_instances": 2,
            "hybrid_context_parallel": True,
            "expert_model_parallel_size": 2,
        },
    ),
    (
        "megatron",
        8,
        {
            "pipeline_model_parallel_size": 4,
            "virtual_pipeline_model_parallel_size": 2,
            "get_embedding_ranks": lambda r: [r[0], r[1], r[-1]],
        },
    ),
]

MEGATRON_DEEPSPEED: list[Case] = [
    (
        "megatron-deepspeed",
        16,
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "use_fp8": True},
    ),
    ("megatron-deepspeed", 8, {"sequence_parallel_size": 4, "use_fp8": True}),
    (
        "megatron-deepspeed",
        8,
        {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": 2},
    ),
    (
        "megatron-deepspeed",
        8,
        {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": -1},
    ),
    ("megatron-deepspeed", 4, {}),
    ("megatron-deepspeed", 8, {"sequence_parallel_size": 2, "use_distributed_optimizer": True}),
    (
        "megatron-deepspeed",
        8,
        {"variant": "habana-2024", "sequence_parallel_size": 2, "use_distributed_optimizer": True},
    ),
]

DEEPSPEED: list[Case] = [
    ("deepspeed", 8, {}),
    ("deepspeed", 12, {}),
    ("deepspeed", 8, {"num_pp": 2, "num_mp": 2, "num_dp": 2}),
    ("deepspeed", 16, {"num_pp": 2, "num_mp": 2, "ep": 2}),
    ("deepspeed", 16, {"num_mp": 2, "ep": 4, "use_data_before_expert_parallel_": True}),
    (
        "deepspeed",
        16,
        {"num_pp": 2, "num_mp": 2, "ep": 2, "enable_expert_tensor_parallelism": True},
    ),
    (
        "deepspeed",
        16,
        {
            "num_mp": 2,
            "ep": 4,
            "use_data_before_expert_parallel_": True,
            "enable_expert_tensor_parallelism": True,
        },
    ),
    ("deepspeed", 8, {"axes": ["pipe", "data", "seq"], "dims": [2, 2, 2]}),  # no tied group
    ("deepspeed", 8, {"num_pp": 4}),
    ("deepspeed", 8, {"axes": ["data", "pipe"], "dims": [2, 4]}),
    ("deepspeed", 8, {"axes": ["x", "y", "z"], "dims": [2, 2, 2], "ep": 2}),
]

VALID: list[Case] = TORCH + OLMO + TORCHTITAN + MEGATRON + MEGATRON_DEEPSPEED + DEEPSPEED
VALID_IDS = _ids(VALID)

#: Configs the framework rejects: the builder must reject them too, the same way.
REJECTED: list[Case] = [
    ("torch", 8, {"mesh_shape": (2, 4), "mesh_dim_names": ("dp", "tp"), "ops": ["flatten tp,dp"]}),
    (
        "torch",
        8,
        {"mesh_shape": (2, 4), "mesh_dim_names": ("dp", "tp"), "ops": ["flatten dp,tp -> tp"]},
    ),
    ("olmo-core", 8, {"tp": 2}),
    ("olmo-core", 8, {"dp": "fsdp", "ep": 2}),
    ("olmo-core", 8, {"dp": "hsdp", "tp": 2, "ep": 2}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 2, "ep": 2}),
    ("olmo-core", 8, {"dp": "ddp", "cp": 3}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 3}),
    ("olmo-core", 8, {"dp": "hsdp", "num_replicas": 2, "shard_degree": 2}),  # IndexError off-mesh
    ("olmo-core", 8, {"dp": "hsdp", "num_nodes": 3, "cp": 2}),  # RuntimeError off-mesh
    ("olmo-core", 4, {"dp": "hsdp", "num_nodes": 8}),  # shard degree 0: ZeroDivisionError
    ("torchtitan", 8, {"dp_shard": 3}),
    ("torchtitan", 8, {"dp_shard": 2, "tp": 2, "ep": 3}),
    ("torchtitan", 8, {"version": "legacy", "dp_shard": 2, "cp": 2, "tp": 2, "ep": 2, "etp": 1}),
    ("torchtitan", 8, {"version": "legacy", "dp_shard": 4, "tp": 2, "ep": 2, "etp": 3}),
    ("torchtitan", 8, {"version": "hyper_parallel", "pp": 2}),
    ("megatron", 16, {"tensor_model_parallel_size": 3}),
    (
        "megatron",
        16,
        {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "order": "tp-dp"},
    ),
    (
        "megatron",
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "order": "tp-cp-pp-ep-dp",
        },
    ),
    ("megatron", 8, {"virtual_pipeline_model_parallel_size": 2}),
    ("megatron", 8, {"context_parallel_size": 2, "num_distributed_optimizer_instances": 3}),
    ("megatron-deepspeed", 8, {"tensor_model_parallel_size": 2, "sequence_parallel_size": 2}),
    (
        "megatron-deepspeed",
        8,
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    ),
    (
        "megatron-deepspeed",
        8,
        {"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": 4},
    ),
    ("megatron-deepspeed", 8, {"tensor_model_parallel_size": 0}),  # ZeroDivisionError
    ("megatron-deepspeed", 8, {"variant": "habana-2024", "sequence_parallel_size": -1}),
    ("deepspeed", 8, {"num_pp": 2, "num_mp": 2, "num_dp": 4}),
    ("deepspeed", 8, {"num_pp": 2, "num_mp": 2, "ep": 3}),
    ("deepspeed", 8, {"num_pp": 2, "num_mp": 2, "ep": 4, "enable_expert_tensor_parallelism": True}),
]
REJECTED_IDS = _ids(REJECTED)

#: Reference kinds a builder does not observe, and why.
UNOBSERVED = {
    # DeepSpeed's p2p "groups" are [rank, next stage] pairs, two per rank: no process group to
    # observe (the pipeline engine sends on the world group).
    "deepspeed": {"p2p"},
}
