"""End-to-end data-flow recipe: a tiny model and dataset trained on N ranks, then both probes.

Every rank builds its framework's meshes (:mod:`meshsim.dataflow.meshes`), loads batches with
``DistributedSampler`` over the data-loading mesh, takes its context-parallel chunk of each
sequence, runs a TP-sharded MLP wrapped in FSDP2 (``fully_shard``; HSDP on a 2-D mesh) or
``DistributedDataParallel`` over the gradient mesh, steps an optimizer with a per-rank loss
scale, and checks gradients in the rank; the parent checks what every rank loaded. ``wiring``
selects the right wiring or one of three classic wrong ones, which the checks must catch.

Pipeline stages each train their own stage module on the batches they load (no activations
cross stages), which is what the data and gradient rules are about.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshsim import torch_private
from meshsim.errors import (
    DataflowMismatch,
    NothingCompared,
    RankFailure,
    RankTimeout,
    UsageError,
)
from meshsim.model import torch_release

#: The right wiring, then the three classic mistakes.
WIRINGS = (
    "correct",
    "sampler_over_gradient_mesh",
    "wrapper_over_data_mesh",
    "tp_different_seeds",
)
STEPS = 2
PER_RANK_BATCH = 2
SEQUENCE = 8
WIDTH = 4


@dataclass(frozen=True)
class NotCompared:
    """A check that found no two ranks to compare (:class:`~meshsim.errors.NothingCompared`):
    what a rank returns instead of a finding, so the result can say so."""

    reason: str


@dataclass(frozen=True)
class DataflowResult:
    """One recipe run: passed when neither the data nor the gradient check found a problem
    on any rank. ``not_compared`` holds why a check had no two ranks to compare (a layout
    without gradient reduction): nothing wrong, nothing proven, and the result says so."""

    framework: str
    world_size: int
    config: Mapping[str, Any]
    backend: str
    wiring: str
    real: bool
    data_error: str | None
    gradient_error: str | None
    seconds: float
    error: str | None = field(default=None)
    not_compared: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.error is None and self.data_error is None and self.gradient_error is None

    def __str__(self) -> str:
        cfg = " ".join(f"{k}={v}" for k, v in self.config.items())
        head = (
            f"{self.framework} {cfg} world_size={self.world_size} on {self.backend} "
            f"(dataflow, {self.wiring} wiring): "
        )
        if self.passed and self.not_compared:
            return head + "PASS only where compared\n" + "\n".join(self.not_compared)
        if self.passed:
            return head + "PASS, batches follow the data mesh and gradients the gradient mesh"
        parts = [p for p in (self.error, self.data_error, self.gradient_error) if p]
        return head + "FAIL\n" + "\n".join(parts)


def check_dataflow(
    framework: str,
    world_size: int,
    backend: str = "gloo",
    *,
    wiring: str = "correct",
    real: bool = False,
    timeout: float = 120.0,
    **config: Any,
) -> DataflowResult:
    """Run the recipe for ``framework``'s convention on ``world_size`` ranks and check it.

    Harness failures (a crash, a hang) come back as ``error``; the checks' findings as
    ``data_error`` / ``gradient_error``. The fake tier cannot move data: ``UsageError``.
    """
    from meshsim.dataflow.data_check import assert_data_parallel
    from meshsim.harness import run
    from meshsim.model.conventions import expect

    refuse(framework, world_size, backend, wiring, real, config, what="the data-flow check")
    expected = expect(framework, world_size, **config)
    start = time.perf_counter()

    def result(**fields: Any) -> DataflowResult:
        values = {"data_error": None, "gradient_error": None, **fields}
        seconds = time.perf_counter() - start
        return DataflowResult(
            framework, world_size, dict(config), backend, wiring, real, seconds=seconds, **values
        )

    try:
        outcomes = list(
            run(
                train_on_rank,
                world_size,
                backend=backend,
                timeout=timeout,
                args=(framework, world_size, dict(config), wiring, real, expected),
            )
        )
    except (RankFailure, RankTimeout) as error:
        return result(error=str(error))
    gradient_errors = sorted({g for _, g in outcomes if isinstance(g, str)})
    not_compared = sorted({g.reason for _, g in outcomes if isinstance(g, NotCompared)})
    data_error = None
    try:
        assert_data_parallel([r for r, _ in outcomes], expected)
    except DataflowMismatch as error:
        data_error = str(error)
    except NothingCompared as error:
        not_compared.insert(0, str(error))
    gradient_error = "\n".join(gradient_errors) if gradient_errors else None
    return result(
        data_error=data_error, gradient_error=gradient_error, not_compared=tuple(not_compared)
    )


def refuse(
    framework: str,
    world_size: int,
    backend: str,
    wiring: str,
    real: bool,
    config: Mapping[str, Any],
    *,
    what: str,
) -> None:
    """``UsageError`` before any rank runs when ``what`` (a check that trains the recipe) cannot
    run this layout: the fake tier, no recipe, an unknown wiring, a framework not installed,
    a layout the recipe does not train."""
    from meshsim.dataflow.meshes import FRAMEWORKS

    if backend == "fake":
        raise UsageError(
            f"{what} needs real collectives: the fake backend moves no data; use "
            "--backend threaded or gloo"
        )
    if framework not in FRAMEWORKS:
        raise UsageError(
            f"the training recipe exists for {', '.join(FRAMEWORKS)}, not {framework!r}"
        )
    if wiring not in WIRINGS:
        raise UsageError(f"unknown wiring {wiring!r}; one of {', '.join(WIRINGS)}")
    if real:
        from meshsim.builders.real import require

        require(framework)
    reason = unsupported(framework, config, backend, world_size=world_size)
    if reason is not None:
        raise UsageError(reason)


def unsupported(
    framework: str, config: Mapping[str, Any], backend: str, *, world_size: int | None = None
) -> str | None:
    """Why the recipe cannot run this layout on ``backend`` (None: it can): what torch 2.13 on
    CPU cannot do, and layouts a recipe does not train (transformers' need ``world_size``)."""
    if world_size is not None:
        refused = _framework_raises(framework, world_size, config)
        if refused is not None:
            return refused
        if framework == "torchtitan":  # degrees left out or -1: read them as inferred
            config = {**config, **_inferred_degrees(framework, world_size, config)}
    if framework == "transformers" and world_size is not None:
        return _transformers_unsupported(world_size, config)
    if framework == "verl" and config.get("strategy", "fsdp") not in ("fsdp", "fsdp2"):
        return (
            "the verl data-flow recipe follows the FSDP engine; the torchtitan engine's "
            "wiring is torchtitan's (meshsim verify torchtitan --dataflow)"
        )
    if _ddp(framework, config) and (config.get("tp") or 1) > 1:
        name = "OLMo-core" if framework == "olmo-core" else "torchtitan"
        return (
            f"{name}'s DDP over a tensor-parallel model cannot run on torch 2.13: "
            "DistributedDataParallel broadcasts DTensor parameters with c10d.broadcast_, which "
            "has no DTensor sharding strategy (NotImplementedError)"
        )
    release = torch_release.installed()
    if framework == "olmo-core" and _hsdp(framework, config) and release and release < (2, 10):
        return (
            f"OLMo-core's HSDP gradient group is a _flatten of (dp_replicate, dp_shard_cp), "
            f"whose dp_shard_cp is already flattened: torch {release[0]}.{release[1]} refuses "
            "that (ValueError; torch >= 2.10 accepts it)"
        )
    return None


def _inferred_degrees(framework: str, world_size: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """The degrees the framework infers (``dp_shard=-1``, or left out), as numbers."""
    from meshsim.errors import LayoutError
    from meshsim.model.conventions import expect

    try:
        normalized = expect(framework, world_size, **config).config
    except LayoutError:
        return {}
    degrees = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    return {k: normalized[k] for k in degrees if isinstance(normalized.get(k), int)}


def _framework_raises(framework: str, world_size: int, config: Mapping[str, Any]) -> str | None:
    """The framework's own error where the reference says building the gradient group raises
    (accelerate FSDP on a mesh without ``dp_shard_cp``: accelerate#3798): nothing trains."""
    from meshsim.errors import LayoutError
    from meshsim.model.conventions import expect

    try:
        expected = expect(framework, world_size, **config)
    except LayoutError:
        return None  # refused by the reference itself: the caller says so first
    unavailable = expected.unavailable()
    # accelerate's FSDP mesh is what its wrapper asks for; without it no gradient role exists.
    for kind in (expected.roles.get("gradient_reduce"), "fsdp_mesh"):
        if kind in unavailable and (kind != "fsdp_mesh" or _accelerate_fsdp(config)):
            return (
                f"{framework} itself raises for this layout where it builds {kind} "
                f"({unavailable[kind].upstream or 'an error'}): {unavailable[kind]}"
            )
    return None


def _accelerate_fsdp(config: Mapping[str, Any]) -> bool:
    return str(config.get("distributed_type", "")).upper() == "FSDP"


def _transformers_unsupported(world_size: int, config: Mapping[str, Any]) -> str | None:
    from meshsim.model.conventions import transformers

    sizes = transformers.resolve(world_size, config)
    if sizes["pp_size"] > 1 and sizes["tp_size"] > 1:
        return (
            "no Trainer runs this layout: it hands accelerate ParallelismConfig(tp_size, "
            "dp_shard_size) without the pipeline degree, which accelerate refuses"
        )
    if config.get("parallelism_config"):
        return (
            "the transformers data-flow recipe follows the Trainer's own ParallelismConfig; "
            "a given parallelism_config is modelled by the reference and adapters only"
        )
    if all(sizes[key] == 1 for key in ("dp_replicate_size", "fsdp_size", "tp_size", "pp_size")):
        return (
            "every transformers size is 1: no DistributedConfig mesh, so the Trainer's plain "
            "DDP through accelerate is what trains (meshsim verify accelerate --dataflow)"
        )
    return None


def _dp(config: Mapping[str, Any]) -> str:
    return str(getattr(config.get("dp"), "value", config.get("dp")))


def _ddp(framework: str, config: Mapping[str, Any]) -> bool:
    """Does the recipe wrap this layout in DistributedDataParallel (no sharding at all)?"""
    if framework == "olmo-core":
        return _dp(config) == "ddp"
    sharded = (config.get("dp_shard") or 1) != 1 or (config.get("cp") or 1) > 1
    return (config.get("dp_replicate") or 1) > 1 and not sharded  # torchtitan: replicate only


def _hsdp(framework: str, config: Mapping[str, Any]) -> bool:
    """Does the recipe wrap this layout in FSDP2 over a 2-D (replicate, shard) mesh?"""
    if framework == "olmo-core":
        return _dp(config) == "hsdp"
    return (config.get("dp_replicate") or 1) > 1  # torchtitan: FSDP2 on (dp_replicate, fsdp)


def train_on_rank(
    framework: str,
    world_size: int,
    config: Mapping[str, Any],
    wiring: str,
    real: bool,
    expected: Any,
) -> tuple[Any, str | NotCompared | None]:
    """On one rank: build, load, train ``STEPS`` steps, check gradients; (record, finding)."""
    import torch
    import torch.distributed as dist

    from meshsim.dataflow import meshes
    from meshsim.dataflow._fresh import fresh_dtensor_caches
    from meshsim.dataflow.grad_check import assert_gradient_sync, loss_scale
    from meshsim.dataflow.records import BatchRecord

    _quiet()
    fresh_dtensor_caches()
    rank = dist.get_rank()
    m = meshes.build(framework, world_size, config, real)
    data_rank, data_size = m.data_rank, m.data_size
    flat = m.gradient_flat() if wiring == "sampler_over_gradient_mesh" else None
    if flat is not None:
        data_rank, data_size = flat.get_local_rank(), flat.size()
    seed = 1234
    if wiring == "tp_different_seeds" and m.tp is not None:
        seed += m.tp.get_local_rank()
    wrap_over = m.data if wiring == "wrapper_over_data_mesh" else m.grad

    model = _model(m.pp_rank)
    if m.tp is not None and m.tp.size() > 1:  # TP over one rank changes nothing
        _shard_tensor_parallel(model, m.tp)
    model = _wrap(model, wrap_over, m.ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    loader = _loader(data_rank, data_size, seed, STEPS * PER_RANK_BATCH * data_size)
    record = BatchRecord(rank)
    chunk = SEQUENCE // m.cp_size
    lo, hi = m.cp_rank * chunk, (m.cp_rank + 1) * chunk
    for ids, samples in loader:
        record.add(ids.tolist(), chunk=(lo, hi))
        out = model(samples[:, lo:hi])
        loss = (out * out).mean() * loss_scale(rank)
        loss.backward()
        optimizer.step()
        if len(record.steps) < STEPS:
            optimizer.zero_grad()
    finding: str | NotCompared | None = None
    try:
        assert_gradient_sync(model, expected)
    except DataflowMismatch as error:
        finding = str(error)
    except NothingCompared as error:
        finding = NotCompared(str(error))
    return record, finding


def _quiet() -> None:
    """Silence the notices the tiny models trigger on every rank (not problems here): FSDP2's
    on a module called outside ``forward``, DTensor's that its random ops on a CPU mesh may be
    incomplete (the own steps initialise full weights and compare them, so a gap would show)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
    warnings.filterwarnings("ignore", "DTensor random operators may not", UserWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _model(stage: int) -> Any:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.float64),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * WIDTH, WIDTH, dtype=torch.float64),
    )
    # The same weights on every replica and TP peer of a stage, from a private generator so the
    # body's own use of torch's global one (seeded or not) cannot shift them.
    generator = torch.Generator().manual_seed(stage)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, dtype=param.dtype, generator=generator) * 0.1)
    return model


def _shard_tensor_parallel(model: Any, tp: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _wrap(model: Any, mesh: Any, ddp: bool) -> Any:
    if mesh is None or mesh.size() == 1:
        return model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        flat = mesh if mesh.ndim == 1 else torch_private.flatten(mesh, "meshsim_ddp")
        return DistributedDataParallel(model, process_group=flat.get_group())
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)


class _Samples:
    """Sample ``i`` is a (SEQUENCE, WIDTH) float64 tensor seeded by ``i``: content = identity."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, Any]:
        import torch

        generator = torch.Generator().manual_seed(index)
        return index, torch.randn(SEQUENCE, WIDTH, dtype=torch.float64, generator=generator)


def _loader(rank: int, size: int, seed: int, samples: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = _Samples(samples)
    sampler = DistributedSampler(
        dataset, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    sampler.set_epoch(0)
    return DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler)
