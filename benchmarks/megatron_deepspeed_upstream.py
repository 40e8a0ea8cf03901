"""Megatron-DeepSpeed's own ``parallel_state.py`` against the ``megatron-deepspeed`` reference.

Megatron-DeepSpeed is not on the package index, so there is no real adapter: this script runs
the file itself, from a checkout, on torch's fake backend, every rank of every config
``meshsim.layouts(N, "megatron-deepspeed", variant="upstream")`` lists (with and without fp8
and the distributed optimizer) and every refusal, and compares each getter's group with the
reference (an ``AssertionError`` from a getter against an unavailable kind; a refusal's type).

Run (on demand, about a minute): fetch microsoft/Megatron-DeepSpeed, then
``python benchmarks/megatron_deepspeed_upstream.py PATH/megatron/core/parallel_state.py``.
Its only import beyond torch is ``GlobalMemoryBuffer`` from ``.utils``, stubbed here.
Prints one JSON line: configs, kind-rank checks, mismatches (listed), refusals reproduced,
and the refusals upstream makes only at getters (negative degrees: ``initialize_model_parallel``
returns and some getters assert; the reference refuses the whole config).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from typing import Any

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import meshsim
from meshsim.errors import LayoutError
from meshsim.model.conventions import megatron_deepspeed

GETTERS = {
    "dp": "get_data_parallel_group",
    "dp:gloo": "get_data_parallel_group_gloo",
    "sp": "get_sequence_parallel_group",
    "seq_dp": "get_sequence_data_parallel_group",
    "mp": "get_model_parallel_group",
    "tp": "get_tensor_model_parallel_group",
    "pp": "get_pipeline_model_parallel_group",
    "embedding": "get_embedding_group",
    "position_embedding": "get_position_embedding_group",
    "amax": "get_amax_reduction_group",
}


def load(path: str) -> Any:
    """A fresh copy of the module (its groups are module globals), ``.utils`` stubbed."""
    package = types.ModuleType("mds_core")
    package.__path__ = []  # type: ignore[attr-defined]
    utils = types.ModuleType("mds_core.utils")
    utils.GlobalMemoryBuffer = type("GlobalMemoryBuffer", (), {})  # type: ignore[attr-defined]
    sys.modules.update({"mds_core": package, "mds_core.utils": utils})
    spec = importlib.util.spec_from_file_location("mds_core.parallel_state", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upstream(path: str, world: int, config: dict[str, Any]) -> dict[int, dict[str, Any]] | str:
    """Every rank's group per getter (``"assert"`` where it asserts; ``"not gloo"`` for a
    ``dp:gloo`` group not made with ``backend="gloo"``), or the refusal's type.

    The fake backend cannot make a gloo group, so ``new_group(backend="gloo")`` makes a fake
    one over the same ranks and remembers that gloo was asked for."""
    config = {k: v for k, v in config.items() if k != "variant"}
    out: dict[int, dict[str, Any]] = {}
    gloo: set[int] = set()

    def new_group(ranks: Any = None, backend: Any = None, **kwargs: Any) -> Any:
        group = real_new_group(ranks=None if ranks is None else list(ranks), **kwargs)
        if backend == "gloo":
            gloo.add(id(group))
        return group

    for rank in range(world):
        state = load(path)
        state.torch.distributed.new_group = new_group
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            state.initialize_model_parallel(**config)
            out[rank] = {}
            for kind, getter in GETTERS.items():
                try:
                    group = getattr(state, getter)()
                except AssertionError:
                    out[rank][kind] = "assert"
                    continue
                made_gloo = kind != "dp:gloo" or id(group) in gloo
                out[rank][kind] = (
                    tuple(dist.get_process_group_ranks(group)) if made_gloo else "not gloo"
                )
        except Exception as error:
            return type(error).__name__
        finally:
            state.torch.distributed.new_group = real_new_group
            dist.destroy_process_group()
    return out


real_new_group = dist.new_group


def main(path: str) -> dict[str, Any]:
    start = time.perf_counter()
    jobs: list[tuple[int, dict[str, Any]]] = []
    for world in (8, 16):
        for flags in ({}, {"use_fp8": False, "use_distributed_optimizer": False}):
            jobs += [
                (world, c) for c in megatron_deepspeed.configs(world, variant="upstream", **flags)
            ]
    refusals = [
        (world, c)
        for world in (8, 16)
        for c in megatron_deepspeed.refused_configs(world)
        if c.get("variant", "upstream") == "upstream"
    ]
    checks, mismatches = 0, []
    for world, config in jobs:
        expected = meshsim.expect("megatron-deepspeed", world, **config)
        real = upstream(path, world, config)
        if isinstance(real, str):
            mismatches.append(f"{world} {config}: upstream raises {real}")
            continue
        for rank, groups in real.items():
            for kind, got in groups.items():
                checks += 1
                if kind in expected.unavailable() or kind not in expected.kinds():
                    mine: Any = "assert"
                else:  # a rank outside every group of the kind: upstream's getter asserts
                    mine = expected.group_of(rank, kind) or "assert"
                if mine != got:
                    mismatches.append(f"{world} {config} rank {rank} {kind}: {mine} vs {got}")
    reproduced, at_getters = 0, []
    for world, config in refusals:
        try:
            meshsim.expect("megatron-deepspeed", world, **config)
            mismatches.append(f"{world} {config}: the reference accepts a refusal")
            continue
        except LayoutError as error:
            said = error.upstream
        real = upstream(path, world, config)
        if real == said:
            reproduced += 1
            continue
        # Negative degrees: initialize_model_parallel returns, and the getters of the groups
        # its empty range() loops never made assert. The reference refuses the whole config.
        asserting = (
            sorted(k for k in GETTERS if all(g[k] == "assert" for g in real.values()))
            if isinstance(real, dict)
            else []
        )
        if said == "AssertionError" and asserting:
            at_getters.append(f"{world} {config}: {', '.join(asserting)} assert")
        else:
            mismatches.append(f"{world} {config}: reference {said}, upstream {real!r:.80}")
    return {
        "configs": len(jobs),
        "kind_rank_checks": checks,
        "mismatches": mismatches,
        "refusals": len(refusals),
        "refusals_reproduced": reproduced,
        "refused_at_getters": at_getters,
        "seconds": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parallel_state", help="megatron/core/parallel_state.py of a checkout")
    print(json.dumps(main(parser.parse_args().parallel_state)))
