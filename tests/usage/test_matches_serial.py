"""The catalogue of planted usage bugs: each trains silently wrong on a real cluster, each is
caught by the comparison with the serial step on threaded and on gloo, first line naming the
value and the likely mistake; each correct twin passes."""

from __future__ import annotations

import functools

import pytest

import meshsim
from meshsim.usage.serial import SerialMismatch
from tests.usage import toy

BACKENDS = ["threaded", "gloo"]
DENSE = {"mesh_shape": (2, 2, 2), "mesh_dim_names": ("dp", "cp", "tp")}
MOE = {"expert_model_parallel_size": 2}

#: bug -> (step options, the first line's start, words the first line must hold)
DENSE_CAUGHT = {
    "norm_grad_not_reduced_over_tp": (
        {},
        "grad of `norm1.weight` at step 1 on ranks 0-7 differs from the serial one",
        [
            "reduced over dp×cp (4 ranks, the gradient_reduce group); the sum over tp (2 ranks, "
            "the tensor group) is the serial value",
            "needs the tp all-reduce",
        ],
    ),
    "loss_averaged_over_dp_not_dp_cp": (
        {},
        "grad of `norm1.weight` at step 1 on ranks 0-7 is 2x the serial one",
        ["2 = dp×cp (4 ranks) / dp (2)", "averaged over dp where the gradient group dp×cp"],
    ),
    "clip_norm_over_local_shard": (
        {"max_norm": 0.05},
        "grad of `norm1.weight` at step 1 on ranks 0-7 is a multiple of the serial one that "
        "differs between ranks",
        ["clipping norm", "over too small a group"],
    ),
    "logged_loss_not_reduced_over_cp": (
        {},
        "logged `loss` at step 1 on ranks 0-7",
        ["the mean over cp (2 ranks, the context group) is the serial value: not averaged over cp"],
    ),
    "accumulation_divided_by_wrong_count": (
        {},
        "grad of `norm1.weight` at step 1 on ranks 0-7 is 0.5x (1/2) the serial one",
        ["divided by a count 2x too large"],
    ),
    "tp_peers_seeded_differently": (
        {},
        "`norm1.weight` before the first step on ranks 1, 3, 5, 7 differs from the serial one",
        ["the initial weights differ", "seeded differently"],
    ),
}
MOE_CAUGHT = {
    "experts_reduced_over_dense_dp": (
        "grad of `experts.0.weight` at step 1 on ranks 0, 2 differs from the serial one",
        [
            "reduced over dp-cp (4 ranks, the gradient_reduce group)",
            "expert parameters are reduced over the expert data-parallel",
        ],
    ),
    "router_grad_misses_other_ep_ranks": (
        "grad of `router.weight` at step 1 on ranks 0-3 differs from the serial one",
        ["a member missing from a reduction"],
    ),
}


def _dense(backend: str, bug: str | None, **options: object) -> meshsim.Expected:
    step = functools.partial(toy.dense_step, bug=bug, **options)
    return meshsim.assert_matches_serial(
        step, 8, "torch", backend=backend, batch=toy.dense_batch, **DENSE
    )


def _moe(backend: str, bug: str | None) -> object:
    step = functools.partial(toy.moe_step, bug=bug)
    return meshsim.assert_matches_serial(
        step, 4, "megatron", backend=backend, batch=toy.moe_batch, **MOE
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bug", sorted(DENSE_CAUGHT))
def test_a_dense_usage_bug_is_caught_and_named(backend: str, bug: str) -> None:
    options, first, words = DENSE_CAUGHT[bug]
    with pytest.raises(SerialMismatch) as caught:
        _dense(backend, bug, **options)
    lead = str(caught.value).splitlines()[0]
    assert lead.startswith(first), lead
    for word in words:
        assert word in lead, (word, lead)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_norm", [float("inf"), 0.05])
def test_the_correct_dense_twin_matches_the_serial_step(backend: str, max_norm: float) -> None:
    result = _dense(backend, None, max_norm=max_norm)
    assert result.comparison.passed
    # 4 parameters (before each step, after the last), 4 gradients, 2 logged values,
    # on every rank, over two steps: nothing skipped.
    assert result.comparison.compared == 8 * (2 * (4 + 4 + 2) + 4)
    assert result.comparison.worst < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bug", sorted(MOE_CAUGHT))
def test_a_moe_usage_bug_is_caught_and_named(backend: str, bug: str) -> None:
    first, words = MOE_CAUGHT[bug]
    with pytest.raises(SerialMismatch) as caught:
        _moe(backend, bug)
    lead = str(caught.value).splitlines()[0]
    assert lead.startswith(first), lead
    for word in words:
        assert word in lead, (word, lead)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_correct_moe_twin_matches_the_serial_step(backend: str) -> None:
    result = _moe(backend, None)
    # Each rank holds 2 of the 4 experts: the router and two experts, three tensors each
    # point, plus the loss; and every expert of the serial model is held by some rank.
    assert result.comparison.compared == 4 * (2 * (3 + 3 + 1) + 3)


def test_a_different_step_count_is_named() -> None:
    def step(ctx: object) -> dict[str, object]:
        import torch

        weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        for _ in range(1 if ctx.serial else 2):  # type: ignore[attr-defined]
            ctx.record({"w": weight})  # type: ignore[attr-defined]
        return {"w": weight}

    with pytest.raises(SerialMismatch, match=r"different number of steps than the serial step"):
        meshsim.assert_matches_serial(step, 2, "torch", mesh_shape=(2,), mesh_dim_names=("dp",))


def test_the_fake_tier_is_refused() -> None:
    with pytest.raises(meshsim.UsageError, match="needs real collectives"):
        meshsim.assert_matches_serial(
            toy.dense_step, 8, "torch", backend="fake", batch=toy.dense_batch, **DENSE
        )


def test_a_step_that_returns_nothing_is_told_what_to_return() -> None:
    def step(ctx: object) -> None:
        return None

    with pytest.raises(meshsim.RankFailure, match="return the model"):
        meshsim.assert_matches_serial(step, 2, "torch", mesh_shape=(2,), mesh_dim_names=("dp",))


def test_a_float32_loss_logged_as_a_float_is_named_rounding_not_a_scale() -> None:
    """A float32 loss averaged by an all-reduce differs from the serial mean in its last bits;
    logged as a Python float it is held to float64's tolerance. The first line says rounding
    (it said "is 1x (1/1) the serial one: a scale that is no ratio of group sizes")."""

    def step(ctx: object, as_float: bool = True) -> dict[str, object]:
        import torch
        import torch.distributed as dist

        weight = torch.nn.Parameter(torch.ones(1))
        values = ctx.batch(0)  # type: ignore[attr-defined]
        size, rank = ctx.size("dp"), ctx.local_rank("dp")  # type: ignore[attr-defined]
        local = values.chunk(size)[rank].sum()
        if size > 1:
            dist.all_reduce(local, group=ctx.group("dp"))  # type: ignore[attr-defined]
        loss = local / values.numel()
        ctx.record({"w": weight}, loss=float(loss) if as_float else loss)  # type: ignore[attr-defined]
        return {"w": weight}

    def batch(i: int) -> object:
        import torch

        return torch.rand(4096, generator=torch.Generator().manual_seed(7)) * 1000

    with pytest.raises(SerialMismatch) as raised:
        meshsim.assert_matches_serial(
            step, 4, "torch", steps=1, batch=batch, mesh_shape=(4,), mesh_dim_names=("dp",)
        )
    first = str(raised.value).splitlines()[0]
    assert first.startswith("logged `loss` at step 1 on ranks 0-3 differs from the serial one")
    assert "rounding, not a wrong group" in first and "float64" in first
    assert "1x (1/1)" not in first
    # Recorded as the float32 tensor it is, it is compared at float32's tolerance: it passes.
    tensor_step = functools.partial(step, as_float=False)
    meshsim.assert_matches_serial(
        tensor_step, 4, "torch", steps=1, batch=batch, mesh_shape=(4,), mesh_dim_names=("dp",)
    )


def _unreduced_replicas(ctx: object) -> dict[str, object]:
    """Data parallelism with no gradient all-reduce: each replica trains on its own rows."""
    import torch

    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    rows = ctx.batch(0)  # type: ignore[attr-defined]
    size, rank = ctx.size("dp"), ctx.local_rank("dp")  # type: ignore[attr-defined]
    (rows.chunk(size)[rank] @ weight).pow(2).mean().backward()
    ctx.record({"w": weight})  # type: ignore[attr-defined]
    return {"w": weight}


def _distinct_rows(i: int) -> object:
    import torch

    return torch.arange(24, dtype=torch.float64).reshape(8, 3) ** 2


@pytest.mark.parametrize(
    ("world", "words"),
    [(2, "rank 0 holds one value, rank 1 another"), (4, "ranks 1-3 others, not all the same")],
)
def test_replicas_that_drift_apart_are_named_without_claiming_the_rest_agree(
    world: int, words: str
) -> None:
    with pytest.raises(SerialMismatch) as raised:
        meshsim.assert_matches_serial(
            _unreduced_replicas, world, "torch", steps=1, batch=_distinct_rows,
            mesh_shape=(world,), mesh_dim_names=("dp",),
        )  # fmt: skip
    lines = str(raised.value).splitlines()
    drift = [line for line in lines if "differs between replicas" in line]
    assert drift and words in drift[0], lines[:6]


def test_a_norm_that_differs_because_replicas_drifted_blames_no_clipping() -> None:
    """A gradient norm differs between ranks either because each rank clipped by its own
    shards' norm, or because the replicas' gradients already differ (a reduction missed a
    dim). Only the first gets the clipping hint: with drifted replicas it would send a user
    hunting through correct clipping code (accelerate's FSDP mesh without cp did that)."""
    from meshsim.usage.compare import NO_RATIO, Finding, _point_to_logged_ratios

    grad = Finding(
        "grads", 1, "w", (0, 1), f"grad of `w` at step 1 on ranks 0, 1 differs: {NO_RATIO}"
    )
    norm = Finding(
        "values", 1, "grad_norm", (0, 1),
        "logged `grad_norm` at step 1 on ranks 0, 1 is a value that differs between ranks",
    )  # fmt: skip
    drift = Finding(
        "grads", 1, "w", (0, 1), "grad of `w` at step 1 differs between replicas: rank 0 ..."
    )
    alone = _point_to_logged_ratios([grad, norm])
    assert "a clipping norm from each rank's own shards" in alone[0].line
    drifted = _point_to_logged_ratios([grad, drift, norm])
    assert drifted[0].line == grad.line
