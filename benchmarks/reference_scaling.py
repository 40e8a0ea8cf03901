"""Time the reference model: all groups of 4-D and 5-D layouts from 2^10 to 2^20 ranks.

Run on demand: ``python benchmarks/reference_scaling.py [--json out.json]``.
For each world size it times (a) every single-axis group family of a 5-D Layout, (b) every
pair-of-axes family (flattened dims), (c) a per-rank query on the last rank, and (d) every
kind of Megatron's ``expect`` (all of its groups, materialised as arrays), and (e) the same
single axes and pairs in torch's own terms: each dim's ``_MeshLayout`` and its global ranks
(``meshsim.model.mesh_layout``), as arrays.
The same workloads side by side with megatron-core's ``RankGenerator`` and DeepSpeed's
``ProcessTopology`` (same groups, cross-checked) are section 2 of ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import meshsim
from meshsim import Layout


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _split(world_exp: int, parts: int) -> list[int]:
    """Split 2^world_exp into ``parts`` power-of-two sizes, as evenly as possible."""
    sizes = [world_exp // parts + (1 if i < world_exp % parts else 0) for i in range(parts)]
    return [2**s for s in sizes]


def run(exponents: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for exp in exponents:
        world = 2**exp
        pp, dp, ep, cp, tp = _split(exp, 5)
        layout = Layout(pp=pp, dp=dp, ep=ep, cp=cp, tp=tp)
        names = layout.dim_names

        def single_axes(layout: Layout = layout, names: tuple[str, ...] = names) -> None:
            for name in names:
                layout.groups_array(name)

        def axis_pairs(layout: Layout = layout, names: tuple[str, ...] = names) -> None:
            for pair in itertools.combinations(names, 2):
                layout.groups_array(*pair)

        def per_rank(
            layout: Layout = layout, world: int = world, names: tuple[str, ...] = names
        ) -> None:
            for name in names:
                layout.group_of(world - 1, name)

        def megatron_all_kinds(
            world: int = world, tp: int = tp, pp: int = pp, cp: int = cp
        ) -> None:
            expected = meshsim.expect(
                "megatron",
                world_size=world,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                context_parallel_size=cp,
            )
            for kind in expected.kinds():
                expected.groups(kind).array  # noqa: B018 - materialise every kind

        def torch_algebra(
            layout: Layout = layout, world: int = world, names: tuple[str, ...] = names
        ) -> None:
            # torch's terms: each dim's _FlatLayout, then its global ranks (complement offsets
            # + the layout's own ranks), every single dim and every pair flattened.
            for name in names:
                layout.mesh_layout(name)[0].global_ranks(world)
            for pair in itertools.combinations(names, 2):
                layout.mesh_layout(*pair).collapse().global_ranks(world)

        layout_4d = Layout(pp=pp, dp=dp * ep, cp=cp, tp=tp)

        def four_d(layout: Layout = layout_4d) -> None:
            for name in layout.dim_names:
                layout.groups_array(name)

        row = {
            "world_size": world,
            "shape_5d": layout.shape,
            "all_single_axis_groups_5d_s": _median_seconds(single_axes, repeat),
            "all_axis_pair_groups_5d_s": _median_seconds(axis_pairs, repeat),
            "all_single_axis_groups_4d_s": _median_seconds(four_d, repeat),
            "per_rank_group_of_all_axes_s": _median_seconds(per_rank, repeat),
            "torch_algebra_axes_and_pairs_5d_s": _median_seconds(torch_algebra, repeat),
        }
        try:
            row["megatron_expect_all_kinds_s"] = _median_seconds(megatron_all_kinds, repeat)
        except Exception as error:  # the Megatron convention may reject a shape; say so
            row["megatron_expect_all_kinds_s"] = f"n/a ({error})"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-exp", type=int, default=10)
    parser.add_argument("--max-exp", type=int, default=20)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args()
    exponents = list(range(args.min_exp, args.max_exp + 1, args.step))
    if exponents[-1] != args.max_exp:
        exponents.append(args.max_exp)
    rows = run(exponents, args.repeat)
    columns = ("5-D axes", "5-D pairs", "4-D axes", "per-rank", "megatron", "torch alg.")
    print(f"{'world':>9} {'5-D shape':>22} " + " ".join(f"{c:>10}" for c in columns))
    for r in rows:
        meg = r["megatron_expect_all_kinds_s"]
        meg_text = f"{meg * 1e3:8.1f}ms" if isinstance(meg, float) else "n/a"
        print(
            f"{r['world_size']:>9} {r['shape_5d']!s:>22} "
            f"{r['all_single_axis_groups_5d_s'] * 1e3:8.1f}ms "
            f"{r['all_axis_pair_groups_5d_s'] * 1e3:8.1f}ms "
            f"{r['all_single_axis_groups_4d_s'] * 1e3:8.1f}ms "
            f"{r['per_rank_group_of_all_axes_s'] * 1e6:8.1f}us "
            f"{meg_text:>10} "
            f"{r['torch_algebra_axes_and_pairs_5d_s'] * 1e3:8.1f}ms"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2, default=str)


if __name__ == "__main__":
    main()
