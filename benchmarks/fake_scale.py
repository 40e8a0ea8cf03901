"""Section 3: the fake tier at scale: every rank's view of a real torch DeviceMesh.

* world 1,024, every rank: ``init_device_mesh("cpu", (8, 8, 16), ("pp", "dp", "tp"))``, slice
  and ``_flatten`` dp,tp, ``meshsim.observe`` (every dim + the flattened dim), then
  ``assert_layout`` against the reference. Target: under 2 s.
* world 131,072, a sample of 64 ranks (``ranks=``), mesh (32, 64, 64), same body and check.

Beside each: the same run with the fake tier's non-member fast path off
(``meshsim.harness.fake_groups``, ``MESHSIM_FAKE_FASTPATH=0``: torch's own ``new_group`` for
every group, as before issue 11), and the floor: the same body in a bare loop
(``init_process_group("fake")`` per rank, body, destroy) with none of meshsim's harness (no
call recording, no divergence check, no isolated world): the difference is what the harness adds.

Why it costs what it costs: on CPU, torch's DeviceMesh creates every group of every dim on every
rank with ``new_group`` (``split_group`` needs an accelerator), so one rank makes
sum_d(world / size_d) ``new_group`` calls: 328 per rank at world 1,024, 335,872 in all.

``--what-if`` (run in full mode) measures, in this process and interleaved, what the slack found
in the harness would save, by monkeypatching (nothing in meshsim/ is edited):

* ``plainworld``: the fake tier swaps in a plain ``c10d._World()`` instead of torch's
  ``ThreadLocalWorld`` (whose every attribute is a property doing a thread-local lookup);
* ``nonmember``: ``_new_group_with_tag`` for a rank outside the new group only validates the
  ranks and advances the group counter (what torch ends up doing for a non-member), skipping
  the rest of torch's path;
* ``owngroup``: DeviceMesh's per-dim group creation makes only this rank's group and advances
  the counter past the others: one ``new_group`` per dim instead of world/size. Group names,
  observations and counters are identical (``check_what_if`` compares them on sampled ranks).
  Inside meshsim the recorder then logs one creation per mesh dim, the same on every rank,
  instead of one per group (otherwise the divergence check would see each rank create a
  different group); ``assert_layout`` still checks every rank's view.

    python benchmarks/fake_scale.py [--quick] [--what-if] [--worlds 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import time
import types
from typing import Any

from _common import dump, fmt_ratio, fmt_s, interleaved, loadavg, md_table

NAMES = ("pp", "dp", "tp")
CASES = {1024: (8, 8, 16), 131072: (32, 64, 64)}
TARGET_S = 2.0


def body(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    import meshsim

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    mesh["dp", "tp"]._flatten("dp_tp")
    return meshsim.observe(mesh)


def sample_ranks(world: int, count: int) -> list[int] | None:
    if count >= world:
        return None
    return list(range(0, world, world // count))[:count]


def meshsim_fake(world: int, shape: tuple[int, ...], ranks: list[int] | None) -> None:
    import meshsim

    observed = meshsim.run(body, world, "fake", timeout=900, ranks=ranks, args=(shape,))
    expected = _expected(world, shape)
    meshsim.assert_layout(observed, expected)


@functools.lru_cache(maxsize=4)
def _expected(world: int, shape: tuple[int, ...]) -> Any:
    import meshsim

    return meshsim.expect(
        "torch", world, mesh_shape=shape, mesh_dim_names=NAMES, ops=["flatten dp,tp"]
    )


def meshsim_fake_slow(world: int, shape: tuple[int, ...], ranks: list[int] | None) -> None:
    """``meshsim_fake`` with the non-member fast path off (the fake tier before issue 11)."""
    from meshsim.harness import fake_groups

    fake_groups.ENABLED = False
    try:
        meshsim_fake(world, shape, ranks)
    finally:
        fake_groups.ENABLED = True


def bare_torch(world: int, shape: tuple[int, ...], ranks: list[int] | None) -> None:
    """The floor: the same body on every (sampled) rank, no harness around it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshsim.harness.isolation import reset_rank_state

    for rank in ranks if ranks is not None else range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            body(shape)
        finally:
            reset_rank_state()


# ---------------------------------------------------------------------------- what-if patches


class Patches:
    """The three what-if changes, switchable per sample (see the module docstring)."""

    def __init__(self) -> None:
        import torch.distributed.distributed_c10d as c10d

        from meshsim.harness import isolation, recorder

        self.c10d, self.isolation, self.recorder = c10d, isolation, recorder
        self.orig_new_group = c10d._new_group_with_tag
        self.orig_threaded_pg_module = isolation.threaded_pg_module
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh_class = DeviceMesh
        self.orig_init_one = DeviceMesh._init_one_process_group

    def nonmember(
        self,
        ranks: Any = None,
        timeout: Any = None,
        backend: Any = None,
        backend_options: Any = None,
        pg_tag: Any = None,
        use_local_synchronization: bool = False,
        group_desc: Any = None,
        device_id: Any = None,
        sort_ranks: bool = True,
    ) -> Any:
        c10d = self.c10d
        if ranks is not None and not use_local_synchronization and not pg_tag and ranks:
            default = c10d._get_default_group()
            valid = len(set(ranks)) == len(ranks) and 0 <= min(ranks) <= max(ranks) < default.size()
            if valid and default.rank() not in ranks:
                c10d._world.group_count += 1
                return c10d.GroupMember.NON_GROUP_MEMBER
        return self.orig_new_group(
            ranks,
            timeout,
            backend,
            backend_options,
            pg_tag,
            use_local_synchronization,
            group_desc,
            device_id,
            sort_ranks,
        )

    def own_group_only(
        self, sub_layout: Any, rank_map: Any, dim_name: str, backend_override: Any
    ) -> Any:
        """DeviceMesh's per-dim group creation, making only this rank's group: the group
        counter advances past the others (names stay what torch gives them)."""
        import torch.distributed as dist
        from torch.distributed._mesh_layout import _MeshLayout

        c10d = self.c10d
        if backend_override != (None, None) or sub_layout.numel() == dist.get_world_size():
            return self.orig_init_one(sub_layout, rank_map, dim_name, backend_override)
        rows = _MeshLayout([sub_layout]).remap_to_tensor(rank_map)
        hit = (rows == dist.get_rank()).any(dim=1).nonzero().flatten().tolist()
        if len(hit) != 1:
            return self.orig_init_one(sub_layout, rank_map, dim_name, backend_override)
        recorder = self.recorder
        sink = recorder._current_sink()
        record = sink is not None and not getattr(recorder._tls, "depth", False)
        # Inside meshsim: one recorded creation per mesh dim, the same on every rank (the
        # proposed recorder change), instead of one per group; the new_group is not recorded.
        call = recorder.Call("create", "split_group", None, f"mesh_{dim_name} {tuple(rows.shape)}")
        if record:
            sink.enter(call)
        recorder._tls.depth = 1
        try:
            c10d._world.group_count += hit[0]
            group = dist.new_group(ranks=rows[hit[0]].tolist(), group_desc=f"mesh_{dim_name}")
            c10d._world.group_count += rows.shape[0] - hit[0] - 1
        finally:
            recorder._tls.depth = 0
        if record:
            sink.exit(call)
        return group.group_name

    def set(self, mode: str) -> None:
        new_group = self.nonmember if "nonmember" in mode else self.orig_new_group
        self.c10d._new_group_with_tag = new_group
        self.mesh_class._init_one_process_group = staticmethod(
            self.own_group_only if "owngroup" in mode else self.orig_init_one
        )
        if "plainworld" in mode:
            plain = types.SimpleNamespace(ThreadLocalWorld=self.c10d._World)
            self.isolation.threaded_pg_module = lambda: plain
        else:
            self.isolation.threaded_pg_module = self.orig_threaded_pg_module


WHAT_IF_MODES = (
    "meshsim",
    "meshsim+plainworld",
    "meshsim+plainworld+nonmember",
    "meshsim+plainworld+owngroup",
    "bare torch",
    "bare torch+nonmember",
    "bare torch+owngroup",
)


def check_what_if(patches: Patches, world: int, shape: tuple[int, ...]) -> bool:
    """The patched paths give each rank the same view, group names and group counter."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshsim.harness.isolation import reset_rank_state

    def view(mode: str, rank: int) -> Any:
        patches.set(mode)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            seen = body(shape)
            groups = {k: (v.members, v.local_rank, v.mesh) for k, v in seen.groups.items()}
            names = sorted(pg.group_name for pg in c10d._world.pg_names)
            return groups, seen.coordinate, names, c10d._world.group_count
        finally:
            reset_rank_state()
            patches.set("")

    ranks = (0, 1, world // 2 - 1, world - 1)
    return all(view("", r) == view("nonmember", r) == view("owngroup", r) for r in ranks)


def what_if(rounds: int) -> dict[str, Any]:
    patches = Patches()
    world, shape = 1024, CASES[1024]
    identical = check_what_if(patches, world, shape)

    def variant(mode: str) -> Any:
        def go() -> None:
            patches.set(mode)
            try:
                if mode.startswith("bare"):
                    bare_torch(world, shape, None)
                else:
                    meshsim_fake(world, shape, None)
            finally:
                patches.set("")

        return go

    results = interleaved({m: variant(m) for m in WHAT_IF_MODES}, rounds)
    return {
        "world_size": world,
        "shape": shape,
        "results": results,
        "patched_views_identical": identical,
        "load_average": loadavg(),
    }


# ---------------------------------------------------------------------------- driver


def run(quick: bool, with_what_if: bool, worlds: tuple[int, ...] = tuple(CASES)) -> dict[str, Any]:
    import torch  # noqa: F401 - imported once, outside the timings

    # Warm-up on a small world: first-use imports (fake PG, DeviceMesh internals) stay out of
    # the timings; every timed sample is then the same work.
    meshsim_fake(8, (2, 2, 2), None)
    bare_torch(8, (2, 2, 2), None)
    rows = []
    for world, shape in CASES.items():
        if world not in worlds:
            continue
        ranks = sample_ranks(world, 64) if world > 1024 else None
        rounds = (3 if quick else 5) if world <= 1024 else (2 if quick else 3)
        variants = {
            "meshsim": functools.partial(meshsim_fake, world, shape, ranks),
            "meshsim_slow": functools.partial(meshsim_fake_slow, world, shape, ranks),
            "bare_torch": functools.partial(bare_torch, world, shape, ranks),
        }
        row = {
            "world_size": world,
            "shape": shape,
            "ranks_run": len(ranks) if ranks else world,
            "load_average": loadavg(),
            **interleaved(variants, rounds, warmup=False),
        }
        rows.append(row)
    out: dict[str, Any] = {"rows": rows, "target_s": TARGET_S}
    if with_what_if:
        out["what_if"] = what_if(3)
    return out


def render(result: dict[str, Any]) -> str:
    head = [
        "world",
        "mesh",
        "ranks run",
        "meshsim fake: wall (CPU)",
        "per rank",
        "fast path off (before): wall (CPU)",
        "bare torch loop: wall (CPU)",
        "meshsim ÷ bare (CPU)",
    ]
    body = []
    for r in result["rows"]:
        m, b, slow = r["meshsim"], r["bare_torch"], r.get("meshsim_slow", {})
        if "median_s" not in m or "median_s" not in b:
            errors = [m.get("error", ""), b.get("error", "")]
            body.append([str(r["world_size"]), "", "", errors[0], "", "", errors[1], ""])
            continue
        before = (
            f"{fmt_s(slow['median_s'])} ({fmt_s(slow['cpu_median_s'])})"
            if "median_s" in slow
            else slow.get("error", "n/a")
        )
        body.append(
            [
                f"{r['world_size']:,}",
                "×".join(map(str, r["shape"])),
                f"{r['ranks_run']:,}",
                f"{fmt_s(m['median_s'])} ({fmt_s(m['cpu_median_s'])})",
                fmt_s(m["median_s"] / r["ranks_run"]),
                before,
                f"{fmt_s(b['median_s'])} ({fmt_s(b['cpu_median_s'])})",
                fmt_ratio(m["cpu_median_s"] / b["cpu_median_s"]),
            ]
        )
    parts = [md_table(head, body)]
    first = result["rows"][0]["meshsim"]
    if "median_s" in first:
        verdict = "met" if first["median_s"] < result["target_s"] else "NOT met"
        parts.append(
            f"Target for world 1,024 (every rank, including `assert_layout`): under "
            f"{fmt_s(result['target_s'])}: {verdict} (median wall {fmt_s(first['median_s'])}, "
            f"CPU {fmt_s(first['cpu_median_s'])}). torch's DeviceMesh makes every group of every "
            "dim on every rank with `new_group` on CPU: 328 calls per rank, 335,872 in all at "
            "world 1,024; the fast path makes only the rank's own group per dim and does the "
            "rest in one step. Load average (1 min) at the start: "
            f"{result['rows'][0]['load_average'][0]:.1f}."
        )
    wi = result.get("what_if")
    if wi:
        base = wi["results"].get("meshsim", {})
        rows = []
        for mode, res in wi["results"].items():
            if "median_s" not in res:
                rows.append([mode, res.get("error", "?"), "", ""])
                continue
            saved = (
                f"{(res['cpu_median_s'] / base['cpu_median_s'] - 1) * 100:+.0f}%".replace("-", "−")
                if "cpu_median_s" in base
                else ""
            )
            rows.append([mode, fmt_s(res["median_s"]), fmt_s(res["cpu_median_s"]), saved])
        same = "identical" if wi.get("patched_views_identical") else "DIFFERENT"
        parts.append(
            "What-if at world 1,024 (monkeypatched in the benchmark process, interleaved; see "
            "`fake_scale.py`; every meshsim variant still passes `assert_layout`; rank views, "
            f"group names and counters with the patches vs without: {same}):\n\n"
            + md_table(["variant", "wall", "CPU", "CPU vs meshsim today"], rows)
        )
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--what-if", action="store_true", help="also measure the fixes")
    parser.add_argument("--json")
    parser.add_argument("--worlds", default=",".join(map(str, CASES)), help="subset of 1024,131072")
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(args.quick, args.what_if, tuple(int(w) for w in args.worlds.split(",")))
    result["seconds"] = time.perf_counter() - start
    print(render(result))
    print(f"\n({fmt_s(result['seconds'])})")
    if args.json:
        dump(args.json, result)


if __name__ == "__main__":
    main()
