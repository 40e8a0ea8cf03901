"""What torch's ``LocalTensorMode`` runs of the serial comparison's steps, how right, how fast.

    python benchmarks/local_tensor.py [--repeat 3] [--worlds 8 64 256] [--out DIR]

``LocalTensorMode`` (``torch.distributed._local_tensor``; in torch 2.13 and 2.15, not 2.9) runs
a program once in one process for every rank of a world: a tensor holds one value per rank, a
collective on a sub-group combines the values of every group of that shape. Four parts, each
against the threaded tier (real collectives, one thread per rank):

1. ``probe``: each collective on three sub-group families at world 8, rank by rank: ok, WRONG or
   the error raised;
2. ``unchanged``: the steps the serial comparison runs today, as they are: ``toy.dense_step``
   (explicit collectives on plain tensors) and the recipe's DTensor TP step under FSDP2 / DDP;
3. ``agree``: the rewrites in ``_local_steps.py`` under the mode vs the threaded tier (and the
   dense rewrite vs the unchanged toy step): the largest absolute difference;
4. ``cost``: median wall and CPU time of one N-rank run of each rewrite, after one warm-up,
   under the mode and on threaded at each world, on gloo at world 8 (a gloo pool of 64 or 256
   processes does not fit 2 cores and 23 GiB).

Writes ``local-tensor-<time>.json`` and ``.md`` under ``--out`` (``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    dump,
    fmt_s,
    loadavg,
    machine,
    machine_line,
    md_table,
    sample,
    summary,
)

#: What a step returns on one rank (one name -> tensor mapping per step), then every rank's.
Trail = list[dict[str, Any]]
Run = list[Trail]


# ---------------------------------------------------------------------------- running


def under_mode(fn: Callable[[], Any], world: int) -> list[Any]:
    """``fn()`` once under ``LocalTensorMode(world)`` on a fake world; rank r's view of it."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with LocalTensorMode(world):
            got = fn()
        return [_on(got, r) for r in range(world)]
    finally:
        dist.destroy_process_group()


def _on(value: Any, rank: int) -> Any:
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(value, LocalTensor):
        return value._local_tensors[rank].detach().clone()
    if isinstance(value, dict):
        return {k: _on(v, rank) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_on(v, rank) for v in value]
    return value.detach().clone() if hasattr(value, "detach") else value


def on_tier(fn: Callable[[], Any], world: int, backend: str) -> list[Any]:
    import meshsim

    return list(meshsim.run(_plain, world, backend, 600, args=(fn,)))


def _plain(fn: Callable[[], Any]) -> Any:
    return _on(fn(), 0)


def worst(a: Run, b: Run) -> float:
    """The largest absolute difference between two runs, every rank, step and tensor."""
    most = 0.0
    for ra, rb in zip(a, b, strict=True):
        for sa, sb in zip(ra, rb, strict=True):
            for name in sa:
                most = max(most, float((sa[name] - sb[name]).abs().max()))
    return most


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:110] if text else ''}"


# ---------------------------------------------------------------------------- 1. probe

PROBE_FAMILIES = {
    "pairs (0,1) (2,3) ...": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "stride 2 (0,2,4,6) (1,3,5,7)": [[0, 2, 4, 6], [1, 3, 5, 7]],
    # Groups of different sizes (all_reduce only: the rest needs one group size).
    "uneven (0,1) (2,3,4,5) (6,7)": [[0, 1], [2, 3, 4, 5], [6, 7]],
}


def _probe_body() -> dict[str, dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()

    def value(r: int) -> Any:
        return torch.arange(4, dtype=torch.float64) * (r + 1) + 10 * r

    x = mode.rank_map(value) if mode is not None else value(dist.get_rank())
    found: dict[str, dict[str, Any]] = {}
    for family, groups in PROBE_FAMILIES.items():
        mine = None
        for members in groups:
            made = dist.new_group(members)
            mine = made if made != dist.GroupMember.NON_GROUP_MEMBER else mine
        only = ("all_reduce",) if family.startswith("uneven") else None
        found[family] = _probe_cases(x, mine, len(groups[0]), dist, funcol, only)
    return found


def _probe_cases(
    x: Any, g: Any, n: int, dist: Any, funcol: Any, only: tuple[str, ...] | None
) -> dict[str, Any]:
    def all_reduce() -> Any:
        y = x.clone()
        dist.all_reduce(y, group=g)
        return y

    def all_gather_list() -> Any:
        parts = [x.new_empty(x.shape) for _ in range(n)]
        dist.all_gather(parts, x, group=g)
        return _cat(parts)

    def all_gather_into_tensor() -> Any:
        out = x.new_empty(x.numel() * n)
        dist.all_gather_into_tensor(out, x, group=g)
        return out

    def reduce_scatter_tensor() -> Any:
        out = x.new_empty(x.numel() // n)
        dist.reduce_scatter_tensor(out, x.clone(), group=g)
        return out

    def broadcast() -> Any:
        y = x.clone()
        dist.broadcast(y, group_src=0, group=g)
        return y

    def all_to_all_single() -> Any:
        out = x.new_empty(x.shape)
        dist.all_to_all_single(out, x.clone(), group=g)
        return out

    def functional_all_reduce() -> Any:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", g)).clone()

    def rank_in_group() -> Any:  # the value only: a tensor op takes a per-rank number
        return x.new_zeros(()) + dist.get_rank(g)

    def rank_in_group_as_int() -> Any:
        return x.new_tensor(int(dist.get_rank(g)))

    def my_chunk() -> Any:
        return x.chunk(n)[dist.get_rank(g)].clone()

    cases = [
        all_reduce, all_gather_list, all_gather_into_tensor, reduce_scatter_tensor, broadcast,
        all_to_all_single, functional_all_reduce, rank_in_group, rank_in_group_as_int, my_chunk,
    ]  # fmt: skip
    out: dict[str, Any] = {}
    for case in cases if only is None else [c for c in cases if c.__name__ in only]:
        try:
            out[case.__name__] = case()
        except Exception as exc:
            out[case.__name__] = _error(exc)
    return out


def _cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts)


def probe() -> list[tuple[str, str, str]]:
    import torch

    threaded = on_tier(_probe_body, 8, "threaded")
    local = under_mode(_probe_body, 8)
    rows = []
    for family in PROBE_FAMILIES:
        for case in threaded[0][family]:
            got = [local[r][family][case] for r in range(8)]
            if isinstance(got[0], str):
                verdict = got[0]
            else:
                bad = [
                    r for r in range(8)
                    if got[r].shape != threaded[r][family][case].shape
                    or not torch.equal(got[r], threaded[r][family][case])
                ]  # fmt: skip
                verdict = f"WRONG on ranks {bad}" if bad else "ok"
            rows.append((family, case, verdict))
    return rows


# ---------------------------------------------------------------------------- 2. unchanged


def unchanged() -> dict[str, str]:
    """The serial comparison's own steps under the mode, as they are."""
    import _local_steps

    from meshsim.model.conventions import expect
    from meshsim.usage.step import StepContext
    from tests.usage import toy

    expected = expect("torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    kept: list[dict[str, Any]] = []

    class Keeping(StepContext):  # the mode has one process for 8 ranks: rank 0 answers
        def record(self, model: Any, **values: Any) -> None:
            kept.append({k: v.detach().clone() for k, v in values.items()})

    def toy_body() -> None:
        ctx = Keeping(rank=0, world_size=8, serial=False, expected=expected,
                      batch=toy.dense_batch, steps=2, seed=0)  # fmt: skip
        toy.dense_step(ctx)

    out: dict[str, str] = {}
    try:
        under_mode(toy_body, 8)
        want = _toy_on_threaded(expected)[0].snapshots[0].values
        got = _on(kept[0], 0)
        out["toy.dense_step"] = (
            "ran to the end, silently wrong: step 1 loss "
            f"{float(got['loss']):.4f} (threaded {float(want['loss'].array):.4f}), grad norm "
            f"{float(got['grad_norm']):.4f} (threaded {float(want['grad_norm'].array):.4f})"
        )
    except Exception as exc:
        out["toy.dense_step"] = "raised " + _error(exc)
    for wrap in ("fsdp2", "ddp"):
        try:
            under_mode(functools.partial(_local_steps.dtensor_tp, 8, wrap=wrap), 8)
            out[f"recipe model, {wrap}"] = "ran"
        except Exception as exc:
            out[f"recipe model, {wrap}"] = "raised " + _error(exc)
    return out


def _toy_on_threaded(expected: Any) -> list[Any]:
    """``toy.dense_step`` on the threaded tier as ``assert_matches_serial`` runs it: trails."""
    import meshsim
    from meshsim.usage.serial import _on_rank
    from tests.usage import toy

    args = (toy.dense_step, 8, expected, toy.dense_batch, 2, 0, False)
    return list(meshsim.run(_on_rank, 8, "threaded", args=args))


# ---------------------------------------------------------------------------- 3, 4. agree, cost


def agree() -> dict[str, float]:
    import _local_steps

    from meshsim.model.conventions import expect

    out = {}
    for name, fn in (("dense", _local_steps.dense), ("dtensor_tp", _local_steps.dtensor_tp)):
        local = under_mode(functools.partial(fn, 8), 8)
        out[f"{name}: mode vs threaded"] = worst(
            local, on_tier(functools.partial(fn, 8), 8, "threaded")
        )
    expected = expect("torch", 8, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    trails = _toy_on_threaded(expected)
    local = under_mode(functools.partial(_local_steps.dense, 8), 8)
    most = 0.0
    for rank, trail in enumerate(trails):
        for step, snap in enumerate(trail.snapshots):
            mine = local[rank][step]
            pairs = [(snap.values[k].array, mine[k]) for k in ("loss", "grad_norm")]
            pairs += [(c.array, mine[f"grad.{n}"]) for n, c in snap.grads.items()]
            most = max(most, *(abs(a - b.numpy()).max() for a, b in pairs))
    out["dense under the mode vs toy.dense_step on threaded"] = float(most)
    return out


def cost(worlds: list[int], repeat: int) -> dict[str, dict[str, Any]]:
    """Median wall and CPU time (this process, its children and pool workers) per tier."""
    import _local_steps

    os.environ["MESHSIM_MAX_WORLD_SIZE"] = str(max(worlds))  # threaded above 64
    out: dict[str, dict[str, Any]] = {}
    for name, fn in (("dense", _local_steps.dense), ("dtensor_tp", _local_steps.dtensor_tp)):
        for world in worlds:
            step = functools.partial(fn, world)
            tiers: dict[str, Callable[[], object]] = {
                "mode": functools.partial(under_mode, step, world),
                "threaded": functools.partial(on_tier, step, world, "threaded"),
            }
            if world == 8:
                tiers["gloo"] = functools.partial(on_tier, step, 8, "gloo")
            for tier, call in tiers.items():
                call()  # warm-up
                got = summary([sample(call) for _ in range(repeat)])
                got["load_1min"] = loadavg()[:1]
                print(f"{name} world {world} {tier}: {got}", file=sys.stderr, flush=True)
                out[f"{name} {world} {tier}"] = got
    return out


# ---------------------------------------------------------------------------- report


def render(info: dict[str, Any], got: dict[str, Any]) -> str:
    out = [machine_line(info)]
    if "probe" in got:
        out += ["", "**1. Collectives on sub-groups, world 8**", ""]
        out.append(md_table(["sub-groups", "call", "under the mode"], got["probe"]))
    if "unchanged" in got:
        out += ["", "**2. The serial comparison's steps, unchanged**", ""]
        out.append(md_table(["step", "under the mode"], list(got["unchanged"].items())))
    if "agree" in got:
        out += ["", "**3. Agreement (largest absolute difference)**", ""]
        diffs = [(k, f"{v:.2g}") for k, v in got["agree"].items()]
        out.append(md_table(["runs", "max abs diff"], diffs))
    if "cost" in got:
        out += ["", "**4. One N-rank run: median wall time (CPU time)**", ""]
        rows = []
        for key in got["cost"]:
            name, world, tier = key.split()
            if tier == "mode":
                cells = [got["cost"].get(f"{name} {world} {t}") for t in TIERS]
                rows.append((name, world, *(_cell(c) for c in cells)))
        out.append(md_table(["step", "world", *TIERS.values()], rows))
    out.append(f"\nLoad average (1 min) at the end: {loadavg()[:1]}.")
    return "\n".join(out) + "\n"


TIERS = {"mode": "LocalTensorMode", "threaded": "threaded", "gloo": "gloo"}
PARTS = ("probe", "unchanged", "agree", "cost")


def _cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "—"
    return f"{fmt_s(result['median_s'])} ({fmt_s(result['cpu_median_s'])})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    for path in (str(ROOT), str(Path(__file__).parent)):
        if path not in sys.path:
            sys.path.insert(0, path)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    info = machine()
    parts: dict[str, Callable[[], Any]] = {
        "probe": probe, "unchanged": unchanged, "agree": agree,
        "cost": functools.partial(cost, args.worlds, args.repeat),
    }  # fmt: skip
    got = {name: parts[name]() for name in PARTS if name in args.parts}
    text = render(info, got)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / time.strftime("local-tensor-%Y%m%d-%H%M%S")
    dump(stem.with_suffix(".json"), {"machine": info, "repeat": args.repeat, **got})
    stem.with_suffix(".md").write_text(text)
    print(f"wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
