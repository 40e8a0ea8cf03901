"""Section 2: the reference model beside megatron-core's RankGenerator and DeepSpeed's
ProcessTopology: every group of 4-D and 5-D layouts, 2^10 to 2^20 ranks.

Three workloads, each done completely by every column (every group of every family is
materialised; nothing lazy is left):

* **4-D axes**: every group of every axis of (pp, dp, cp, tp).
  meshsim: ``Layout(...).groups_array(axis)`` per axis, as contiguous int64 arrays, and again
  converted to Python lists (``.tolist()``: what the frameworks hand back).
  Megatron: ``RankGenerator(tp, ep=1, dp, pp, cp, order="tp-cp-dp-pp").get_ranks(axis)``.
  DeepSpeed: ``ProcessTopology(axes, dims)`` then ``get_axis_comm_lists(axis)`` per axis.
* **5-D axes + pairs**: (pp, dp, ep, cp, tp): every axis and every pair of axes (a flattened
  dim such as dp-cp). megatron-core's ``RankGenerator`` refuses ep and cp together in one
  grid, so the Megatron column calls the function it delegates to,
  ``generate_masked_orthogonal_rank_groups(world, sizes, mask)``, with one mask per family.
  DeepSpeed has no multi-axis group API, so its column does the 5 axes only (and says so).
* **Megatron, all kinds**: everything ``initialize_model_parallel`` computes for
  tp/pp/cp/ep: meshsim's ``expect("megatron", ...)`` (16 kinds: 9 decoder tokens, embedding,
  position embedding, 5 expert tokens), against megatron-core's own two ``RankGenerator`` grids
  with the same 14 ``get_ranks`` tokens and the default embedding-rank rules.

Before timing, every column's groups are compared with meshsim's (as sets of ordered groups)
at every world up to ``CHECK_UP_TO``; the result is in the JSON (``agree``).

    python benchmarks/scaling_vs_frameworks.py [--quick] [--json out.json]
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from _common import (
    cell,
    fmt_ratio,
    fmt_s,
    interleaved,
    loadavg,
    md_table,
    ratio,
    section_main,
)

#: Worlds up to this size are cross-checked (every column against meshsim) before timing.
CHECK_UP_TO = 2**14
ORDER_4D = "tp-cp-dp-pp"  # Megatron order string: fastest axis first = row-major (pp, dp, cp, tp)
AXES_5D = ("pp", "dp", "ep", "cp", "tp")  # row-major, last fastest
MEGATRON_DECODER_TOKENS = ("dp-cp", "dp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp")
MEGATRON_EXPERT_TOKENS = ("ep", "tp", "tp-ep", "tp-ep-pp", "dp")
MEGATRON_ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default


def split(world_exp: int, parts: int) -> list[int]:
    """2^world_exp as ``parts`` power-of-two sizes, as even as possible, larger ones first."""
    sizes = [world_exp // parts + (1 if i < world_exp % parts else 0) for i in range(parts)]
    return [2**s for s in sizes]


# ---------------------------------------------------------------------------- imports


def _quiet_import(what: str) -> tuple[Any, str | None]:
    """Import a framework's piece; (object, None) or (None, why it failed)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        if what == "megatron":
            from megatron.core.parallel_state import (
                RankGenerator,
                generate_masked_orthogonal_rank_groups,
            )

            return (RankGenerator, generate_masked_orthogonal_rank_groups), None
        from deepspeed.runtime.pipe.topology import ProcessTopology

        return ProcessTopology, None
    except Exception as exc:  # any import failure skips the column, with the reason
        return None, f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        logging.disable(logging.NOTSET)


# ---------------------------------------------------------------------------- workloads


def meshsim_4d(sizes: dict[str, int], as_lists: bool) -> Callable[[], list[Any]]:
    import numpy as np

    from meshsim import Layout

    def go() -> list[Any]:
        layout = Layout(**sizes)
        out = [np.ascontiguousarray(layout.groups_array(n)) for n in layout.dim_names]
        return [a.tolist() for a in out] if as_lists else out

    return go


def meshsim_5d(sizes: dict[str, int], as_lists: bool) -> Callable[[], list[Any]]:
    import numpy as np

    from meshsim import Layout

    def go() -> list[Any]:
        layout = Layout(**sizes)
        families = [(n,) for n in layout.dim_names] + list(
            itertools.combinations(layout.dim_names, 2)
        )
        out = [np.ascontiguousarray(layout.groups_array(*f)) for f in families]
        return [a.tolist() for a in out] if as_lists else out

    return go


def megatron_4d(mod: Any, sizes: dict[str, int]) -> Callable[[], list[Any]]:
    rank_generator, _ = mod

    def go() -> list[Any]:
        gen = rank_generator(
            tp=sizes["tp"], ep=1, dp=sizes["dp"], pp=sizes["pp"], cp=sizes["cp"], order=ORDER_4D
        )
        return [gen.get_ranks(axis) for axis in ("pp", "dp", "cp", "tp")]

    return go


def megatron_5d(mod: Any, sizes: dict[str, int]) -> Callable[[], list[Any]]:
    _, generate = mod
    fastest_first = list(reversed(AXES_5D))
    parallel_size = [sizes[a] for a in fastest_first]
    world = math.prod(parallel_size)
    families = [(a,) for a in AXES_5D] + list(itertools.combinations(AXES_5D, 2))

    def go() -> list[Any]:
        return [
            generate(world, parallel_size, [a in family for a in fastest_first])
            for family in families
        ]

    return go


def deepspeed_axes(topology: Any, axes: tuple[str, ...], sizes: dict[str, int]):  # type: ignore[no-untyped-def]
    def go() -> list[Any]:
        topo = topology(axes=list(axes), dims=[sizes[a] for a in axes])
        return [topo.get_axis_comm_lists(a) for a in axes]

    return go


def megatron_config(sizes5: dict[str, int]) -> dict[str, int]:
    return {
        "tensor_model_parallel_size": sizes5["tp"],
        "pipeline_model_parallel_size": sizes5["pp"],
        "context_parallel_size": sizes5["cp"],
        "expert_model_parallel_size": sizes5["ep"],
    }


def meshsim_megatron_kinds(world: int, sizes5: dict[str, int], as_lists: bool):  # type: ignore[no-untyped-def]
    import meshsim

    config = megatron_config(sizes5)

    def go() -> dict[str, Any]:
        expected = meshsim.expect("megatron", world_size=world, **config)
        out = {k: expected.groups(k).array for k in expected.kinds()}
        return {k: v.tolist() for k, v in out.items()} if as_lists else out

    return go


def megatron_all_kinds(mod: Any, world: int, sizes5: dict[str, int]):  # type: ignore[no-untyped-def]
    """What ``initialize_model_parallel`` computes, with megatron-core's own RankGenerator."""
    rank_generator, _ = mod
    tp, pp, cp, ep = sizes5["tp"], sizes5["pp"], sizes5["cp"], sizes5["ep"]
    dp = world // (tp * pp * cp)
    edp = world // (tp * ep * pp)

    def go() -> dict[str, Any]:
        decoder = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=MEGATRON_ORDER)
        expert = rank_generator(tp=tp, ep=ep, dp=edp, pp=pp, cp=1, order=MEGATRON_ORDER)
        out: dict[str, Any] = {}
        for token in MEGATRON_DECODER_TOKENS:
            out[token] = decoder.get_ranks(token)
            if token == "pp":  # as initialize_model_parallel does, inside the pp loop
                out["embedding"] = [[r[0], r[-1]] if len(r) > 1 else [r[0]] for r in out["pp"]]
                out["position_embedding"] = [[r[0]] for r in out["pp"]]
        for token in MEGATRON_EXPERT_TOKENS:
            out[f"expert:{token}"] = expert.get_ranks(token)
        # What initialize_model_parallel derives with one distributed-optimizer instance (its
        # default): each gloo group holds its NCCL twin's ranks, the intra-instance groups are
        # the whole data-parallel ones, and the one instance is every rank.
        out["dp:gloo"] = out["dp"]
        out["dp-cp:gloo"] = out["intra_dp_cp"] = out["intra_dp_cp:gloo"] = out["dp-cp"]
        out["expert:dp:gloo"] = out["expert:intra_dp"] = out["expert:dp"]
        out["expert:intra_dp:gloo"] = out["expert:dp"]
        out["intra_dist_opt_instance"] = [list(range(world))]
        return out

    return go


# ---------------------------------------------------------------------------- checking


def _same(ours: Any, theirs: Any) -> bool:
    """Same families as sets of ordered groups (frameworks enumerate groups differently)."""

    def canon(family: Any) -> set[tuple[int, ...]]:
        rows = family.tolist() if hasattr(family, "tolist") else family
        return {tuple(int(r) for r in row) for row in rows}

    if isinstance(ours, dict):
        return set(ours) == set(theirs) and all(canon(ours[k]) == canon(theirs[k]) for k in ours)
    return len(ours) == len(theirs) and all(canon(a) == canon(b) for a, b in zip(ours, theirs))


# ---------------------------------------------------------------------------- driver


def run(quick: bool) -> dict[str, Any]:
    exps = [10, 13, 16, 20] if quick else [10, 12, 14, 16, 18, 20]
    framework_cap = 2**16 if quick else 2**20
    rounds = 5 if quick else 7
    # Seconds a framework column may spend per world before it stops taking samples (it keeps
    # at least one); and the longest single sample we are willing to start (projected from the
    # previous world, x4.5 per 4x ranks).
    budget = 20.0 if quick else 90.0
    sample_cap = 60.0 if quick else 400.0
    megatron, megatron_why = _quiet_import("megatron")
    deepspeed, deepspeed_why = _quiet_import("deepspeed")
    # (table, column) -> (exponent, median seconds) of the last world measured, to project
    # the next sample (these generators are linear in the world size: x2.2 per doubling).
    last: dict[tuple[str, str], tuple[int, float]] = {}
    tables: dict[str, list[dict[str, Any]]] = {"4d": [], "5d": [], "megatron_kinds": []}
    agree: dict[str, bool] = {}

    def skip_reason(table: str, column: str, exp: int, why_missing: str | None) -> str | None:
        if why_missing:
            return why_missing
        if 2**exp > framework_cap:
            return f"--quick caps the framework columns at 2^{framework_cap.bit_length() - 1} ranks"
        if (table, column) in last:
            prev_exp, prev_s = last[(table, column)]
            projected = prev_s * 2.2 ** (exp - prev_exp)
            if projected > sample_cap:
                return (
                    f"one sample projected at {fmt_s(projected)} (> {fmt_s(sample_cap)}) from "
                    f"2^{prev_exp}"
                )
        return None

    for exp in exps:
        world = 2**exp
        s4 = dict(zip(("pp", "dp", "cp", "tp"), split(exp, 4)))
        s5 = dict(zip(AXES_5D, split(exp, 5)))
        work: dict[str, dict[str, Callable[[], Any]]] = {
            "4d": {
                "meshsim_arrays": meshsim_4d(s4, as_lists=False),
                "meshsim_lists": meshsim_4d(s4, as_lists=True),
            },
            "5d": {
                "meshsim_arrays": meshsim_5d(s5, as_lists=False),
                "meshsim_lists": meshsim_5d(s5, as_lists=True),
            },
            "megatron_kinds": {
                "meshsim_arrays": meshsim_megatron_kinds(world, s5, as_lists=False),
                "meshsim_lists": meshsim_megatron_kinds(world, s5, as_lists=True),
            },
        }
        skipped: dict[str, dict[str, str]] = {t: {} for t in work}
        framework_work = {
            ("4d", "megatron"): (megatron_why, partial(megatron_4d, megatron, s4)),
            ("4d", "deepspeed"): (
                deepspeed_why,
                partial(deepspeed_axes, deepspeed, ("pp", "dp", "cp", "tp"), s4),
            ),
            ("5d", "megatron"): (megatron_why, partial(megatron_5d, megatron, s5)),
            ("5d", "deepspeed"): (deepspeed_why, partial(deepspeed_axes, deepspeed, AXES_5D, s5)),
            ("megatron_kinds", "megatron"): (
                megatron_why,
                partial(megatron_all_kinds, megatron, world, s5),
            ),
        }
        for (table, column), (why, make) in framework_work.items():
            reason = skip_reason(table, column, exp, why)
            if reason:
                skipped[table][column] = reason
            else:
                work[table][column] = make()
        for table, variants in work.items():
            if world <= CHECK_UP_TO:
                ours = variants["meshsim_arrays"]()
                for column, fn in variants.items():
                    if column.startswith("meshsim"):
                        continue
                    theirs = fn()
                    if table == "5d" and column == "deepspeed":
                        ours_cmp = ours[: len(AXES_5D)]  # DeepSpeed: the 5 axes, no pairs
                    else:
                        ours_cmp = ours
                    agree[f"{table}/{column}/{world}"] = _same(ours_cmp, theirs)
            slow = {c: budget for c in variants if not c.startswith("meshsim")}
            # Warm-up: meshsim's columns always; the frameworks' only where the cross-check did
            # not just run them (it did at worlds <= CHECK_UP_TO), and never at big worlds.
            warm = [c for c in variants if c.startswith("meshsim")]
            results = interleaved(variants, rounds, budget_s=slow, warmup=warm)
            for column, reason in skipped[table].items():
                results[column] = {"skipped": reason}
            for column, res in results.items():
                if "median_s" in res:
                    last[(table, column)] = (exp, res["median_s"])
            row = {"world_size": world, "load_average": loadavg(), **results}
            row["shape"] = s4 if table == "4d" else s5
            tables[table].append(row)
    return {
        "tables": tables,
        "agree": agree,
        "all_agree": all(agree.values()) if agree else None,
        "rounds": rounds,
        "framework_budget_s": budget,
        "sample_cap_s": sample_cap,
        "framework_cap_ranks": framework_cap,
        "columns": {
            "meshsim_arrays": "meshsim, int64 (num_groups, group_size) arrays, contiguous",
            "meshsim_lists": "meshsim, the same converted to list[list[int]] (.tolist())",
            "megatron": "megatron-core, list[list[int]] (RankGenerator.get_ranks / "
            "generate_masked_orthogonal_rank_groups)",
            "deepspeed": "DeepSpeed ProcessTopology: constructor + get_axis_comm_lists per "
            "axis, list[list[int]]",
        },
        "unavailable": {
            k: v for k, v in (("megatron", megatron_why), ("deepspeed", deepspeed_why)) if v
        },
    }


TITLES = {
    "4d": "Every group of every axis, 4-D (pp, dp, cp, tp): 4 families",
    "5d": "5-D (pp, dp, ep, cp, tp): every axis and every pair of axes, 15 families "
    "(DeepSpeed: the 5 axes only, it has no multi-axis API)",
    "megatron_kinds": "Megatron, every kind `initialize_model_parallel` builds for tp/pp/cp/ep "
    "(16 families)",
}


def render(result: dict[str, Any]) -> str:
    parts = []
    notes: list[str] = []
    for table, rows in result["tables"].items():
        columns = ["meshsim_arrays", "meshsim_lists", "megatron"]
        if table != "megatron_kinds":
            columns.append("deepspeed")
        head = ["world", "shape", "meshsim (arrays)", "meshsim (lists)", "Megatron"]
        if "deepspeed" in columns:
            head.append("DeepSpeed")
        head.append("Megatron ÷ meshsim (lists / arrays)")
        if "deepspeed" in columns:
            head.append("DeepSpeed ÷ meshsim (lists / arrays)")
        body = []
        for r in rows:
            shape = "×".join(str(v) for v in r["shape"].values())
            line = [f"2^{r['world_size'].bit_length() - 1}", shape]
            line += [cell(r.get(c)) for c in columns]
            for framework in columns[2:]:
                line.append(
                    f"{fmt_ratio(ratio(r.get(framework), r.get('meshsim_lists')))} / "
                    f"{fmt_ratio(ratio(r.get(framework), r.get('meshsim_arrays')))}"
                )
            body.append(line)
            for c in columns:
                info = r.get(c) or {}
                for key in ("skipped", "error"):
                    if key in info:
                        note = f"{c} {key}: {info[key]}"
                        if note not in notes:
                            notes.append(note)
        parts.append(f"**{TITLES[table]}**\n\n" + md_table(head, body))
    agree = result.get("agree") or {}
    checked = sorted({k.split("/")[0] + "/" + k.split("/")[1] for k in agree})
    verdict = "identical groups" if result.get("all_agree") else "MISMATCH: see JSON `agree`"
    parts.append(
        f"Cross-check before timing (worlds ≤ {CHECK_UP_TO:,}): {', '.join(checked)}: {verdict}. "
        "Times include building the layout/generator/topology. Slow columns stop sampling after "
        f"{result['framework_budget_s']:.0f} s per world (at least one sample)."
    )
    parts += [f"¹ {n}" for n in notes]
    return "\n\n".join(parts)


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    section_main(__doc__, run, render)


if __name__ == "__main__":
    main()
