"""Lightning 2.6.6's own training step (Fabric), on N ranks and alone, for the equivalence check.

What runs is a Fabric training loop with Lightning's own objects: ``Fabric(accelerator="cpu",
strategy=ModelParallelStrategy(parallelize_fn, data_parallel_size, tensor_parallel_size))``,
``fabric.launch()`` (the strategy's ``setup_environment``: its 2-D ``("data_parallel",
"tensor_parallel")`` device mesh), ``fabric.setup(model)`` (which calls the parallelize
function with that mesh), ``fabric.setup_optimizers``, ``fabric.setup_dataloaders`` (a
``DistributedSampler`` over the strategy's ``distributed_sampler_kwargs``: the data-parallel
rank and size, so TP peers load the same rows), then per step ``fabric.backward``,
``fabric.all_reduce(loss, reduce_op="mean")`` (the logged loss), ``fabric.clip_gradients(...,
max_norm=0.5)`` (which clips here) and the AdamW step. The parallelize function is the user's
part, written as Lightning's tensor-parallel docs recipe does it: torch's ``parallelize_module``
on ``device_mesh["tensor_parallel"]`` (colwise / rowwise linears, a rowwise embedding, sequence
parallel norms) when that dim has more than one rank, then FSDP2 ``fully_shard`` of each block
and the root on ``device_mesh["data_parallel"]`` when that one has. The model is a tiny
Llama-style transformer (2 blocks, vocab 256) built in full from ``torch.manual_seed(ctx.seed)``
on every rank and in the twin, then parallelized. The serial twin is the same Fabric with both
sizes 1 on one CPU process.

ModelParallelStrategy runs on the CPU unchanged: neither it nor Fabric's connector checks for
CUDA (the strategy only passes ``device_id`` to ``init_process_group`` for non-CPU devices, and
uses ``init_device_mesh(root_device.type, ...)``), so there is no shim. What the harness needs
is only what the real adapter (:mod:`meshsim.builders.real.lightning`) already hands the
strategy: a ``ClusterEnvironment`` that reports the harness's ranks (Lightning's own read
``os.environ``) and creates processes externally, so ``launch()`` keeps the harness's default
group (``_init_dist_connection`` returns early when one exists).

The step runs on threaded ranks too (Lightning's only process-global, ``rank_zero_only.rank``,
picks which rank prints). ``before``, when given, runs on each rank (and in the twin) before
anything is built: tests plant bugs there. What it patches on Lightning's strategy and on this
module is put back after the run, so a warm gloo worker runs the next layout unpatched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

GLOBAL_BATCH = 8  # rows: splits over 1, 2, 4 or 8 data-parallel ranks
SEQUENCE = 33  # tokens per row: 32 inputs and their next-token labels
VOCABULARY = 256
WIDTH = 64
HEADS = 8  # so that a tensor-parallel group of 8 splits them
LAYERS = 2
MAX_GRAD_NORM = 0.5

WHAT_RUNS = (
    "Lightning's own Fabric step: ModelParallelStrategy (its device mesh, setup of the "
    "parallelize_fn: parallelize_module on tensor_parallel, fully_shard on data_parallel), "
    "setup_dataloaders' distributed sampler, fabric.backward, all_reduce of the loss, "
    "clip_gradients, AdamW, on a tiny Llama-style transformer"
)


def refusal(world_size: int, config: Mapping[str, Any]) -> str | None:
    """Why this step does not run ``config`` (None: it does). Lightning's own refusals (sizes
    that do not multiply to the world) are the reference's too."""
    nodes = config.get("num_nodes") or 1
    data = config.get("data_parallel_size", "auto")
    tensor = config.get("tensor_parallel_size", "auto")
    data = nodes if data == "auto" else int(data)
    tensor = world_size // nodes if tensor == "auto" else int(tensor)
    head = "Lightning's own step"
    if HEADS % tensor or (SEQUENCE - 1) % tensor:
        return (
            f"{head} with tensor_parallel_size={tensor}: its tiny model's {HEADS} attention heads "
            f"and {SEQUENCE - 1}-token sequences (sequence-parallel norms) split over 1, 2, 4 or 8 "
            "TP ranks only"
        )
    if GLOBAL_BATCH % data:
        return (
            f"{head} with data_parallel_size={data}: a global batch of {GLOBAL_BATCH} rows "
            "does not split over it"
        )
    return None


def batch(step: int) -> Any:
    """A step's global batch: token ids, inputs ``[:, :-1]`` and labels ``[:, 1:]``."""
    import torch

    return torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE), dtype=torch.int64)


def step(
    config: Mapping[str, Any], before: Callable[[], None] | None = None
) -> Callable[[Any], Any]:
    """The step function for :func:`meshsim.assert_matches_serial`."""
    return functools.partial(_step, dict(config), before)


def _modules() -> Any:
    """The tiny transformer's classes (built on first use: torch is imported lazily)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = WIDTH // HEADS
            self.wq, self.wk, self.wv, self.wo = (
                nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows, tokens, _ = x.shape
            # -1 heads: the heads this rank holds (all of them without TP)
            q, k, v = (
                w(x).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
                for w in (self.wq, self.wk, self.wv)
            )
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(rows, tokens, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
            self.w2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)
            self.w3 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.RMSNorm(WIDTH)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(WIDTH)
            self.feed_forward = FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCABULARY, WIDTH)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.RMSNorm(WIDTH)
            self.output = nn.Linear(WIDTH, VOCABULARY, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))

    return Transformer


#: Which dims of Lightning's device mesh the parallelize function uses (tests plant bugs here).
TENSOR_DIM = "tensor_parallel"
DATA_DIM = "data_parallel"


def parallelize(model: Any, device_mesh: Any) -> Any:
    """The user's ``parallelize_fn``, as Lightning's docs recipe writes it: TP over the
    ``tensor_parallel`` dim (sequence-parallel norms), then FSDP2 over ``data_parallel``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh = device_mesh[TENSOR_DIM]
    dp_mesh = device_mesh[DATA_DIM]
    if tp_mesh.size() > 1:
        parallelize_module(
            model,
            tp_mesh,
            {
                "tok_embeddings": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        for block in model.layers:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(**gather),
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(**gather),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    if dp_mesh.size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _sizes(world_size: int, config: Mapping[str, Any], serial: bool) -> dict[str, Any]:
    if serial:
        return {"data_parallel_size": 1, "tensor_parallel_size": 1}
    return {
        "data_parallel_size": config.get("data_parallel_size", "auto"),
        "tensor_parallel_size": config.get("tensor_parallel_size", "auto"),
    }


def _fabric(config: Mapping[str, Any], ctx: Any) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from meshsim.builders.real.lightning import _environment

    nodes = 1 if ctx.serial else int(config.get("num_nodes") or 1)
    per_node = ctx.world_size // nodes
    strategy = ModelParallelStrategy(
        parallelize_fn=lambda model, mesh: parallelize(model, mesh),  # read at call time
        **_sizes(ctx.world_size, config, ctx.serial),
    )
    return Fabric(
        accelerator="cpu",
        devices=per_node,
        num_nodes=nodes,
        strategy=strategy,
        plugins=[_environment(per_node)],
    )


def _step(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch.distributed as dist

    from meshsim.builders.real import _shims

    # Threaded ranks share this process: one rank putting attributes back while another still
    # trains would unplant the bug there (the tests' fixtures put them back instead).
    shared = ctx.world_size > 1 and str(dist.get_backend()) == "threaded"
    with _shims.unchanged_environ():  # Lightning's launch writes MASTER_ADDR and the like
        _shims.load("lightning.fabric")
        with _put_back(None if shared else before):
            return _train(config, before, ctx)


def _train(config: dict[str, Any], before: Callable[[], None] | None, ctx: Any) -> Any:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from meshsim.dataflow import recipes

    recipes._quiet()
    _quiet_lightning()
    if before is not None:
        before()
    fabric = _fabric(config, ctx)
    fabric.launch()
    torch.manual_seed(ctx.seed)
    model = fabric.setup(_modules()())
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    )
    replicas = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    rows = torch.cat([ctx.batch(i) for i in range(ctx.steps)])
    loader = fabric.setup_dataloaders(DataLoader(rows, batch_size=GLOBAL_BATCH // replicas))
    logged: dict[str, Any] = {}

    def before_update(inner: Any, args: Any, kwargs: Any) -> None:
        ctx.record(model.module, loss=logged["loss"], grad_norm=logged["grad_norm"])

    optimizer.optimizer.register_step_pre_hook(before_update)
    for tokens in loader:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        fabric.backward(loss)
        logged["loss"] = fabric.all_reduce(loss.detach().clone(), reduce_op="mean")
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_GRAD_NORM)
        logged["grad_norm"] = norm.detach().clone()
        optimizer.step()
        optimizer.zero_grad()
    return model.module


def _quiet_lightning() -> None:
    """Lightning's notices on every rank (the experimental strategy, the CPU as accelerator)."""
    import logging
    import warnings

    for name in ("lightning.fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")


#: What a ``before`` hook may patch: put back after the run (a warm gloo worker runs the next
#: layout, and the twin runs in the caller's process).
PATCHABLE = (
    "lightning.fabric.strategies.model_parallel:ModelParallelStrategy",
    "lightning.fabric.strategies.strategy:Strategy",
    "lightning.fabric.fabric:Fabric",
    "meshsim.own_steps.lightning",
)


def _put_back(before: Callable[[], None] | None) -> Any:
    """Restore the attributes of :data:`PATCHABLE` that ``before`` (a planted bug) replaced."""
    from meshsim.own_steps import put_back

    return put_back(before, PATCHABLE)
