"""The data-flow recipes' training step under :func:`~meshsim.assert_matches_serial`.

The same tiny model, sampler and wrapper as :mod:`meshsim.dataflow.recipes`, minus the
per-rank loss scale (a serial step has one rank): on N ranks each rank builds its framework's
meshes, loads its share with ``DistributedSampler``, takes its context-parallel chunk and
trains the TP-sharded model under FSDP2 / HSDP / DDP; the serial twin loads every share in one
batch (a shuffled ``DistributedSampler`` hands the data ranks of a step one contiguous block
of its permutation, which one replica with a batch ``data_size`` times larger reads whole)
and trains each pipeline stage's model on it, as each stage does in the recipe.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshsim.errors import RankFailure, RankTimeout, SerialMismatch, UsageError


@dataclass(frozen=True)
class RecipeEquivalence:
    """One recipe run under the serial comparison: ``error`` holds the finding or crash."""

    framework: str
    world_size: int
    config: Mapping[str, Any]
    backend: str
    wiring: str
    error: str | None
    seconds: float
    summary: str = ""
    #: What trained: meshsim's recipe on the framework's meshes, or the framework's own step.
    step: str = "meshsim's recipe"

    @property
    def passed(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        cfg = " ".join(f"{k}={v}" for k, v in self.config.items())
        head = (
            f"{self.framework} {cfg} world_size={self.world_size} on {self.backend} "
            f"(equivalence, {self.wiring} wiring): "
        )
        return head + (f"PASS, {self.summary}" if self.passed else f"FAIL\n{self.error}")


def check_equivalence(
    framework: str,
    world_size: int,
    backend: str = "gloo",
    *,
    wiring: str = "correct",
    real: bool = False,
    timeout: float = 120.0,
    **config: Any,
) -> RecipeEquivalence:
    """Train ``framework``'s recipe on ``world_size`` ranks and on one, and compare them."""
    from meshsim.dataflow.recipes import refuse
    from meshsim.model.conventions import expect
    from meshsim.own_steps import own_step
    from meshsim.usage.serial import assert_matches_serial

    own = own_step(framework) if real else None
    if own is not None and wiring == "correct":
        return _own_step_equivalence(own, framework, world_size, backend, timeout, config)
    refuse(framework, world_size, backend, wiring, real, config, what="the equivalence check")
    expected = expect(framework, world_size, **config)
    stages = _size(expected, "pipeline")
    data_size = _size(expected, "data_parallel")
    step = functools.partial(_train, framework, dict(config), real, wiring, stages, data_size)
    error, summary, seconds = _judged(
        lambda: assert_matches_serial(step, world_size, expected, backend=backend, timeout=timeout)
    )
    return RecipeEquivalence(
        framework, world_size, dict(config), backend, wiring, error, seconds, summary
    )


def equivalence_refusal(
    framework: str, world_size: int, backend: str, *, real: bool = False, **config: Any
) -> str | None:
    """Why :func:`check_equivalence` would not train this layout, known before any rank runs
    (None: it will try; a rank may still refuse). A sweep asks first, so that its progress
    and estimate count only the layouts that train."""
    from meshsim.dataflow.recipes import refuse
    from meshsim.own_steps import own_step

    own = own_step(framework) if real else None
    try:
        if own is not None:
            _refuse_own_step(own, framework, world_size, backend, config)
        else:
            refuse(framework, world_size, backend, "correct", real, config, what="the step")
    except UsageError as refusal:
        return str(refusal)
    return None


def _refuse_own_step(
    own: Any, framework: str, world_size: int, backend: str, config: Mapping[str, Any]
) -> None:
    from meshsim.builders.real import require
    from meshsim.usage.serial import BACKENDS

    if backend not in BACKENDS:
        raise UsageError(
            f"the equivalence check needs real collectives, not backend {backend!r}; use "
            "--backend threaded or gloo"
        )
    require(framework)
    reason = own.refusal(world_size, config)
    if reason is not None:
        raise UsageError(reason)


def _own_step_equivalence(
    own: Any,
    framework: str,
    world_size: int,
    backend: str,
    timeout: float,
    config: Mapping[str, Any],
) -> RecipeEquivalence:
    """The framework's own step (``meshsim.own_steps``) on N ranks against its serial twin."""
    from meshsim.usage.serial import assert_matches_serial

    _refuse_own_step(own, framework, world_size, backend, config)
    step = own.step(config)
    error, summary, seconds = _judged(
        lambda: assert_matches_serial(
            step, world_size, framework, backend=backend, batch=own.batch, timeout=timeout, **config
        )
    )
    return RecipeEquivalence(
        framework, world_size, dict(config), backend, "correct", error, seconds, summary,
        step=own.WHAT_RUNS,
    )  # fmt: skip


def _judged(compare: Callable[[], Any]) -> tuple[str | None, str, float]:
    """(error, summary, seconds) of one serial comparison. A step's own refusal on every rank
    (``UsageError``) is raised as one: it is no finding about the step."""
    start = time.perf_counter()
    try:
        summary = str(compare()).split(": ", 1)[1]
    except RankFailure as exc:
        refusal = _recipe_refusal(exc)
        if refusal is not None:
            raise UsageError(refusal) from None
        return str(exc), "", time.perf_counter() - start
    except (SerialMismatch, RankTimeout) as exc:
        return str(exc), "", time.perf_counter() - start
    return None, summary, time.perf_counter() - start


def _recipe_refusal(error: RankFailure) -> str | None:
    """The step's own refusal (every failing rank raised ``UsageError``: a layout the recipe or
    own step does not train), which is no finding about the step."""
    failures = error.failures
    if failures and all(o.error_type == "UsageError" for o in failures):
        return str(failures[0].error_message)
    return None


def _size(expected: Any, role: str) -> int:
    """The size of ``role``'s groups; 1 where the layout has no such role."""
    if role not in expected.roles:
        return 1
    return len(expected.groups(role)[0])


def _train(
    framework: str,
    config: Mapping[str, Any],
    real: bool,
    wiring: str,
    stages: int,
    data_size: int,
    ctx: Any,
) -> dict[str, Any]:
    from meshsim.dataflow import recipes
    from meshsim.dataflow._fresh import fresh_dtensor_caches

    recipes._quiet()
    fresh_dtensor_caches()
    if ctx.serial:
        return _train_serial(stages, data_size, ctx)
    return _train_ranks(framework, config, real, wiring, ctx)


def _train_ranks(
    framework: str, config: Mapping[str, Any], real: bool, wiring: str, ctx: Any
) -> dict[str, Any]:
    import torch

    from meshsim.dataflow import meshes, recipes

    m = meshes.build(framework, ctx.world_size, config, real)
    data_rank, data_size = m.data_rank, m.data_size
    flat = m.gradient_flat() if wiring == "sampler_over_gradient_mesh" else None
    if flat is not None:
        data_rank, data_size = flat.get_local_rank(), flat.size()
    seed = 1234
    if wiring == "tp_different_seeds" and m.tp is not None:
        seed += m.tp.get_local_rank()
    wrap_over = m.data if wiring == "wrapper_over_data_mesh" else m.grad
    model = recipes._model(m.pp_rank)
    if m.tp is not None and m.tp.size() > 1:  # TP over one rank changes nothing
        recipes._shard_tensor_parallel(model, m.tp)
    model = recipes._wrap(model, wrap_over, m.ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = recipes.STEPS * recipes.PER_RANK_BATCH * data_size
    loader = recipes._loader(data_rank, data_size, seed, samples)
    chunk = recipes.SEQUENCE // m.cp_size
    lo, hi = m.cp_rank * chunk, (m.cp_rank + 1) * chunk
    for _, batch in loader:
        out = model(batch[:, lo:hi])
        (out * out).mean().backward()
        ctx.record(_staged(model, m.pp_rank))
        optimizer.step()
        optimizer.zero_grad()
    return _staged(model, m.pp_rank)


def _train_serial(stages: int, data_size: int, ctx: Any) -> dict[str, Any]:
    """Every stage's model, each trained on the whole global batch of every step."""
    import torch

    from meshsim.dataflow import recipes

    models = [recipes._model(stage) for stage in range(stages)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    samples = recipes.STEPS * recipes.PER_RANK_BATCH * data_size
    loader = recipes._loader(0, 1, 1234, samples)
    loader = torch.utils.data.DataLoader(
        loader.dataset, batch_size=recipes.PER_RANK_BATCH * data_size, sampler=loader.sampler
    )
    for _, batch in loader:
        for model in models:
            out = model(batch)
            (out * out).mean().backward()
        ctx.record(_all_stages(models))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return _all_stages(models)


def _staged(model: Any, stage: int) -> dict[str, Any]:
    from meshsim.usage.step import plain_name

    return {f"stage{stage}.{plain_name(n)}": p for n, p in model.named_parameters()}


def _all_stages(models: list[Any]) -> dict[str, Any]:
    named: dict[str, Any] = {}
    for stage, model in enumerate(models):
        named.update(_staged(model, stage))
    return named
