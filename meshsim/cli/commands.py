"""The show, diff and verify verbs: config in, reference or live check out, exit code back."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from meshsim.cli import config_flags as cf
from meshsim.cli import dataflow as dataflow_cli
from meshsim.cli import equivalence as equivalence_cli
from meshsim.cli import render
from meshsim.cli.compare import (
    DIFFERENT,
    REORDERED,
    SAME,
    Comparison,
    any_difference,
    compare_kinds,
    compare_roles,
)
from meshsim.errors import UsageError
from meshsim.model.conventions import expect
from meshsim.model.expected import Expected
from meshsim.model.groups import format_groups


def _config(args: argparse.Namespace, framework: str, world: int) -> dict[str, Any]:
    return cf.config_for(framework, world, cf.native_settings(args), cf.shared_degrees(args))


# -- show ---------------------------------------------------------------------------------------
def show(args: argparse.Namespace) -> int:
    zoom = None
    if args.zoom is not None:
        from meshsim.cli import picture

        if not (args.svg or args.png):
            raise UsageError("--zoom picks the ranks a picture draws; give --svg or --png too")
        zoom = picture.parse_zoom(args.zoom)
        picture.check_zoom(zoom, args.world_size)
    expected = expect(
        args.framework, args.world_size, **_config(args, args.framework, args.world_size)
    )
    rows = render.kind_rows(expected, args.gpus_per_node)
    if args.kinds:  # --kinds repeats: every occurrence adds its kinds
        names = [k.strip() for text in args.kinds for k in text.split(",") if k.strip()]
        if not names:
            raise UsageError(f"--kinds takes kind or role names, got {args.kinds[-1]!r}")
        wanted = {expected.kind(name).name for name in names}
    elif args.all_kinds:
        wanted = set(expected.kinds()) | set(expected.unavailable())
    else:
        wanted = set(expected.primary_kinds())
    rows = [r for r in rows if r.name in wanted]
    hidden = [n for n in (*expected.kinds(), *expected.unavailable()) if n not in wanted]
    out = render.console(stderr=args.json)
    if args.svg or args.png:
        from meshsim.cli import picture

        title = (
            f"{expected.framework} · world {expected.world_size} · "
            f"{render.config_text(expected.config, short=True)}"
        ).rstrip(" ·")
        if args.gpus_per_node:
            title += f" · {args.gpus_per_node} GPUs per node"
        footer = [
            f"unavailable {name}: {' '.join(str(err).split())}"
            for name, err in expected.unavailable().items()
            if name in wanted
        ]
        page = picture.scene(
            title,
            rows,
            expected.world_size,
            columns=args.columns,
            gpus_per_node=args.gpus_per_node,
            footer=footer,
            zoom=zoom,
        )
        width, height = page.pixels
        for path, write in ((args.svg, picture.write_svg), (args.png, picture.write_png)):
            if path:
                write(page, path)
                out.print(
                    f"wrote {path} ({_count(len(page.panels), 'panel')}, {width} x {height} px)"
                )
    if args.json:
        report = render.show_json(
            expected, rows, args.gpus_per_node, wanted, args.first, all_groups=args.all_groups
        )
        render.print_json(
            {
                "verb": "show",
                "schema_version": render.JSON_SCHEMA_VERSION,
                "exit_code": 0,
                **report,
                "kinds_hidden": hidden,
                "findings": findings_json(expected),
            }
        )
        return 0
    render.show(
        out,
        expected,
        rows,
        first=args.first,
        grid=not args.no_grid,
        columns=args.columns,
        gpus_per_node=args.gpus_per_node,
        only=wanted,
    )
    if hidden and not args.kinds:
        out.print(
            f"[dim]{len(hidden)} more kinds (each getter call and view dim, available or "
            f"not): --all-kinds lists them, --kinds K,K picks some[/dim]"
        )
    print_findings(out, expected)
    return 0


# -- diff ---------------------------------------------------------------------------------------
def diff(args: argparse.Namespace) -> int:
    world = args.world_size
    a, b = _diff_sides(args)
    roles = compare_roles(a, b)
    kinds = compare_kinds(a, b) if a.framework == b.framework else []
    if not [c for c in roles + kinds if c.shape_a is not None and c.shape_b is not None]:
        raise UsageError(
            f"A ({a.framework}) and B ({b.framework}) share no role or kind, so nothing was "
            "compared; pick layouts that both define a role (data_parallel, "
            "gradient_reduce, ...) or the same framework"
        )
    differ = any_difference(roles) or any_difference(kinds)
    if args.json:
        render.print_json(
            {
                "verb": "diff",
                "schema_version": render.JSON_SCHEMA_VERSION,
                "exit_code": 1 if differ else 0,
                "world_size": world,
                "a": {"framework": a.framework, "config": dict(a.config)},
                "b": {"framework": b.framework, "config": dict(b.config)},
                "roles": [c.to_json() for c in roles],
                "kinds": [c.to_json() for c in kinds],
                "differ": differ,
            }
        )
        return 1 if differ else 0
    out = render.console()
    out.print(f"[bold]A[/bold] {a.framework} {render.config_text(a.config)}")
    out.print(f"[bold]B[/bold] {b.framework} {render.config_text(b.config)}")
    changed = [k for k in {**a.config, **b.config} if a.config.get(k) != b.config.get(k)]
    if a.framework == b.framework:
        out.print(f"world_size={world}; configs differ in: {', '.join(changed) or 'nothing'}")
    else:
        out.print(f"world_size={world}")
    out.print(_comparison_table("role", roles))
    if kinds:
        changed = [c for c in kinds if c.verdict != SAME]
        same = [c.name for c in kinds if c.verdict == SAME]
        if changed:
            out.print(_comparison_table("kind", changed))
        if same:
            out.print(f"[dim]kinds identical in A and B: {', '.join(same)}[/dim]")
    shared = [c for c in roles + kinds if c.shape_a is not None]
    count = sum(c.verdict in (DIFFERENT, REORDERED) for c in shared)
    what = "roles and kinds" if kinds else "roles"
    if differ:
        out.print(f"[red]{count} of {len(shared)} shared {what} put different ranks together")
    else:
        out.print(f"[green]A and B put the same ranks together for all {len(shared)} shared {what}")
    return 1 if differ else 0


def _diff_sides(args: argparse.Namespace) -> tuple[Expected, Expected]:
    """A's and B's references. Config reaches a side from five places (shared degrees, a
    framework's own flags, ``A:key=value``, ``--a-set``, ``--a-order``); two of them setting one
    key to different values is refused, naming both, never resolved silently (a dropped
    ``--a-set`` once made A equal B and the diff a vacuous pass)."""
    world = args.world_size
    (fa, only_a), (fb, only_b) = cf.split_spec(args.a), cf.split_spec(args.b)
    degrees = cf.shared_degrees(args)
    said = {d: f"{cf.flag(d)} {v}" for d, v in degrees.items()}
    native = cf.native_settings(args)
    common: dict[str, Any] = {}
    for key, value in native.items():
        degree = cf.degree_of(fa, key) or cf.degree_of(fb, key)
        if degree is not None:
            if degree in degrees and degrees[degree] != value:
                raise UsageError(
                    f"{said[degree]} and {native.written(key)} set the same degree to different "
                    "values; give one of them"
                )
            degrees[degree] = value
            said[degree] = native.written(key)
        elif key in cf.parameters(fa) or key in cf.parameters(fb):
            common[key] = value
        else:
            raise UsageError(f"neither {fa} nor {fb} takes config key {key!r}")
    sides = []
    for side, framework, spec, sets, order in (
        ("A", fa, only_a, args.a_set, args.a_order),
        ("B", fb, only_b, args.b_set, args.b_order),
    ):
        params = cf.parameters(framework)
        config = cf.translated(framework, world, degrees, said, owner=f"{framework} ({side})")
        for key, value in common.items():
            if key in params:
                config.put(key, value, *native.source(key))
        for key, value in spec.items():
            config.put(key, value, f"{side}:", f"{side}'s :{key}={value}")
        flag = f"--{side.lower()}-set"
        for text in sets:
            key, value = cf.parse_setting(text, framework)
            config.put(key, value, flag, f"{flag} {text}")
        if order is not None:
            if "order" not in params:
                raise UsageError(
                    f"--{side.lower()}-order: {framework} ({side}) has no order parameter; "
                    f"its keys: {', '.join(params)}"
                )
            config.put("order", order, f"--{side.lower()}-order", f"--{side.lower()}-order {order}")
        sides.append(expect(framework, world, **config))
    a, b = sides
    if a.framework == b.framework and dict(a.config) == dict(b.config):
        raise UsageError(
            f"A and B are the same {a.framework} config ({render.config_text(a.config)}), so "
            "they agree by construction; give one side its own setting (B:key=value, --b-set "
            "KEY=VALUE, --b-order)"
        )
    return a, b


def _comparison_table(what: str, comparisons: list[Comparison]) -> Table:
    table = Table(header_style="bold")
    by_kind = what == "kind"  # kinds compare by name: A's and B's kind are the row's name
    titles = (what, "verdict", "ranks differing", "example")
    if not by_kind:
        titles = (what, "A kind", "B kind", *titles[1:])
    for title in titles:
        table.add_column(title, no_wrap=title in (what, "verdict"))
    for c in comparisons:
        colour = {SAME: "green", DIFFERENT: "red", REORDERED: "yellow"}.get(c.verdict, "dim")
        example = ""
        if c.example is not None:
            rank, ga, gb = c.example
            example = f"rank {rank}: A {_group(ga)} vs B {_group(gb)}"
        elif c.shape_a and c.verdict == SAME:
            example = format_groups(c.sample, 2, c.shape_a[0])
        cells = [
            f"[{colour}]{c.verdict}[/]",
            str(c.ranks) if c.verdict in (DIFFERENT, REORDERED) else "",
            example,
        ]
        kinds = [] if by_kind else [c.kind_a or "–", c.kind_b or "–"]
        table.add_row(c.name, *kinds, *cells)
    return table


def _group(group: tuple[int, ...] | None) -> str:
    return "none" if group is None else format_groups([group])[1:-1]


# -- verify -------------------------------------------------------------------------------------
def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) inside a torchrun job, else None.

    Same test as the harness (RANK, WORLD_SIZE and MASTER_ADDR set), which then runs the
    gloo/nccl tiers on the job's own processes instead of spawning ranks.
    """
    if all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        try:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise UsageError(
                f"torchrun's RANK={os.environ['RANK']!r} and WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']!r} must be integers"
            ) from None
    return None


def verify(args: argparse.Namespace) -> int:
    launched = torchrun_env()
    world = args.world_size
    if launched is not None:
        if world is not None and world != launched[1]:
            raise UsageError(
                f"--world-size {world} differs from torchrun's WORLD_SIZE {launched[1]}"
            )
        world = launched[1]
    if world is None:
        raise UsageError("verify needs --world-size (or a torchrun launch that sets WORLD_SIZE)")
    config = _config(args, args.framework, world)
    expected = expect(args.framework, world, **config)  # bad config: exit 2 before any rank runs
    dataflow = getattr(args, "dataflow", False)
    if dataflow:
        dataflow_cli.check_args(args)
    equivalence = getattr(args, "equivalence", False)
    if equivalence:
        equivalence_cli.check_args(args)
    verify_fn = _verify_api()
    started = time.perf_counter()
    try:
        result = verify_fn(
            args.framework, world, args.backend, real=args.real, timeout=args.timeout, **config
        )
    except ModuleNotFoundError as exc:
        raise UsageError(_missing_framework(args.framework, exc)) from None
    wall = time.perf_counter() - started
    quiet = launched is not None and launched[0] != 0
    out = render.console(stderr=args.json, quiet=quiet)
    flow = dataflow_cli.run(args, world, config) if dataflow else None
    twin = equivalence_cli.run(args, world, config) if equivalence else None
    passed = result.passed and (flow is None or flow.passed) and (twin is None or twin.passed)
    if args.strict and _violations(expected):
        passed = False
    if args.json:
        if not quiet:
            report = {
                "verb": "verify",
                "schema_version": render.JSON_SCHEMA_VERSION,
                "exit_code": 0 if passed else 1,
                **result_json(result),
                # Defaults filled in, so a defaulted key that picks a line (megatron-deepspeed's
                # variant, torchtitan's version) is named too.
                "config_normalized": dict(expected.config),
                "wall_seconds": wall,
                "findings": findings_json(expected),
            }
            if flow is not None:
                report["dataflow"] = dataflow_cli.as_json(flow)
            if twin is not None:
                report["equivalence"] = equivalence_cli.as_json(twin)
            render.print_json(report)
        return 0 if passed else 1
    print_result(out, result, expected, wall)
    if flow is not None:
        dataflow_cli.print_result(out, flow)
    if twin is not None:
        equivalence_cli.print_result(out, twin)
    print_findings(out, expected, strict=args.strict)
    return 0 if passed else 1


def _violations(expected: Expected) -> list[Any]:
    from meshsim.model.invariants import find_violations

    return find_violations(expected)


def findings_json(expected: Expected) -> list[dict[str, str]]:
    """The reference layout's broken invariants, as JSON (``[]`` when it has none)."""
    return [
        {"check": v.check, "kind": v.kind, "message": v.message, "consequence": v.consequence}
        for v in _violations(expected)
    ]


def print_findings(out: Any, expected: Expected, *, strict: bool | None = None) -> None:
    """Say where the framework's own layout is wrong, however well the build matched it: a
    build that matches a broken layout passes ``verify`` (``--strict`` fails it; ``strict``
    None: the verb has no such flag)."""
    found = _violations(expected)
    if not found:
        return
    how = {None: "", True: " (a failure under --strict)", False: " (--strict fails on it)"}
    out.print(
        f"[yellow]finding[/yellow]: the layout {expected.framework}'s own rules give here "
        f"breaks {len(found)} invariant(s){how[strict]}:"
    )
    for violation in found:
        out.print(f"  - {violation}", markup=False)


def _verify_api() -> Any:
    try:
        from meshsim import verify as module
    except ModuleNotFoundError as exc:
        if exc.name in ("meshsim.verify", "meshsim.harness"):
            raise UsageError("this meshsim build has no meshsim.verify yet") from None
        raise UsageError(f"verify needs {exc.name}: pip install meshsim") from None
    return module.verify


def _missing_framework(framework: str, exc: ModuleNotFoundError) -> str:
    from meshsim.builders.real import install_hint

    return f"--real needs {framework} installed ({exc.name} is missing); {install_hint(framework)}"


def _views_of(result: Any, kind: str) -> list[Any]:
    """Every rank's GroupView of ``kind`` (none where the rank holds no such group)."""
    observations = getattr(result, "observations", None) or ()
    return [o.groups[kind] for o in observations if kind in o.groups]


def _proof_text(result: Any, views: list[Any], unproven: bool, ok: bool) -> str:
    """Whether an all-gather over the kind's groups returned their members, or why not asked."""
    if result.backend == "fake":
        return "no (fake tier)"
    if unproven:
        return "no"
    if not views:
        return "–"  # no rank holds such a group (the framework raises, or returns None)
    if any(v.gathered is not None for v in views):
        return "yes" if ok else "–"
    if all(v.backends is None for v in views):
        return "– (rank list)"
    if any(v.disagreement for v in views):
        return "no (members disagree)"
    return "– (fake backend)"


def kinds_checked(result: Any) -> list[str]:
    checked = getattr(result, "kinds_checked", ()) or ()
    return list(checked.keys() if isinstance(checked, Mapping) else checked)


def print_result(out: Any, result: Any, expected: Expected, wall: float | None = None) -> None:
    """``wall`` is the whole call (rank or pool start included); ``result.seconds`` only the
    slowest rank's build plus the diff. Both are printed, each saying what it measures."""
    mode = "real framework" if result.real else "meshsim's builder"
    timing = f"{result.seconds:.2f} s build+check"
    if wall is not None:
        timing = f"{wall:.1f} s wall ({timing}; the rest starts the ranks)"
    out.print(
        f"[bold]{result.framework}[/bold] world_size={result.world_size} "
        f"{render.config_text(expected.config)} on {result.backend} ({mode}), {timing}"
    )
    if result.error:
        out.print("[red]error[/red]: ", end="")
        out.print(str(result.error), markup=False)
    if result.diff is not None:
        out.print("[red]MISMATCH[/red]")
        out.print(str(result.diff), markup=False)
    table = Table(header_style="bold")
    for title in ("kind", "#groups", "size", "backend", "matches reference", "proven"):
        table.add_column(title, no_wrap=True)
    bad = {m.kind for m in getattr(result.diff, "mismatches", ())}
    unproven = {m.kind for m in getattr(result.diff, "mismatches", ()) if m.aspect == "proof"}
    for kind in kinds_checked(result):
        ref = expected.kind(kind)
        groups = ref.groups() if ref.available else None
        ok = kind not in bad and not result.error
        views = _views_of(result, kind)
        if groups is None:  # the framework raises for this kind, and the build did too
            matches = "yes (raises)" if ok else "no"
        else:
            matches = "yes" if ok else "no"
        table.add_row(
            Text(kind),  # names like dense[tp] are not rich markup
            str(len(groups)) if groups is not None else "–",
            str(groups.group_size) if groups is not None else "–",
            ", ".join(sorted({b for v in views for b in (v.backends or ())})) or "–",
            f"[green]{matches}[/green]" if ok else f"[red]{matches}[/red]",
            _proof_text(result, views, kind in unproven, ok),
        )
    out.print(table)
    for kind, why in (getattr(result, "skipped", None) or {}).items():
        out.print(f"[yellow]skipped[/yellow] {kind}: ", end="")
        out.print(why, markup=False)
    for limit in getattr(result, "tier_limits", ()):
        out.print(f"[dim]{result.backend} tier: {limit}; --backend gloo asks it[/dim]")
    verdict = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
    rejected = getattr(result, "rejected", None)
    what = (
        f"both reject the config ({rejected})"
        if rejected
        else (f"{len(kinds_checked(result))} kinds checked")
    )
    out.print(f"{verdict}: {what}")


def result_json(result: Any) -> dict[str, Any]:
    return {
        "framework": result.framework,
        "world_size": result.world_size,
        "config": dict(result.config),
        "backend": result.backend,
        "real": result.real,
        "passed": result.passed,
        "seconds": result.seconds,
        "kinds_checked": kinds_checked(result),
        "kinds_skipped": dict(getattr(result, "skipped", None) or {}),
        "tier_limits": list(getattr(result, "tier_limits", ())),
        "error": None if result.error is None else str(result.error),
        "diff": None if result.diff is None else str(result.diff),
    }


__all__ = ["diff", "list_conventions", "show", "verify"]


# -- list ---------------------------------------------------------------------------------------
def convention_catalogue(frameworks: list[str], world_size: int) -> list[dict[str, Any]]:
    """Each convention's config keys and every kind its valid layouts at ``world_size`` build.

    Kinds depend on the config (pipeline kinds appear only with pp > 1), so they are collected
    over every layout ``meshsim.layouts`` enumerates, with the roles they serve.
    """
    from meshsim.model.sweep import layouts

    out = []
    for name in frameworks:
        cf.check_framework(name)
        kinds: dict[str, dict[str, Any]] = {}
        for case in layouts(world_size, name):
            expected = expect(name, world_size, **case.config)
            roles: dict[str, list[str]] = {}
            for role, kind in expected.roles.items():
                roles.setdefault(kind, []).append(role)
            for kind in [*expected.kinds(), *expected.unavailable()]:
                entry = kinds.setdefault(
                    kind, {"name": kind, "description": "", "roles": [], "layouts": 0}
                )
                ref = expected.kind(kind)
                entry["description"] = entry["description"] or (
                    ref.description if ref.available else ""
                )
                entry["roles"] = sorted(set(entry["roles"]) | set(roles.get(kind, ())))
                entry["layouts"] += 1
        out.append(
            {
                "framework": name,
                "config_keys": [
                    {"key": key, "flag": cf.flag(key), "help": text}
                    for key, text in cf.parameters(name).items()
                ],
                "kinds": list(kinds.values()),
                "layouts": len(layouts(world_size, name)),
            }
        )
    return out


def convention_summary(frameworks: list[str]) -> list[tuple[str, int, str]]:
    """(name, number of config keys, what it models) of each convention: its module's first
    docstring paragraph. Cheap: no layout is enumerated (the full listing builds every one)."""
    from meshsim.model.conventions import convention

    out = []
    for name in frameworks:
        cf.check_framework(name)
        paragraph = (convention(name).__doc__ or "").strip().split("\n\n")[0]
        out.append((name, len(cf.parameters(name)), " ".join(paragraph.replace("``", "").split())))
    return out


def list_conventions(args: argparse.Namespace) -> int:
    """A line per convention by default; in full (keys, flags, kinds) for the named ones, with
    ``--all``, and always in ``--json``."""
    world = 8
    names = list(dict.fromkeys(args.frameworks)) or _all_frameworks()  # each once
    if not (args.json or args.all or args.frameworks):
        out = render.console()
        out.print(
            f"{len(names)} conventions; meshsim list NAME (or --all) lists keys and kinds:",
            markup=False,
        )
        summary = convention_summary(names)
        wide = max(len(name) for name, _, _ in summary)
        for name, count, what in summary:
            head = f"{name:<{wide}}  {count:>2} keys  "
            room = max(out.width - len(head), 20)  # one line each: cut, never wrapped
            text = what if len(what) <= room else what[: room - 1].rstrip() + "…"
            out.print(head + text, markup=False, highlight=False)
        return 0
    catalogue = convention_catalogue(names, world)
    if args.json:
        render.print_json(
            {
                "verb": "list",
                "schema_version": render.JSON_SCHEMA_VERSION,
                "exit_code": 0,
                "world_size": world,
                "conventions": catalogue,
            }
        )
        return 0
    out = render.console()
    for entry in catalogue:
        out.print(
            f"[bold]{entry['framework']}[/bold]  ({entry['layouts']} valid layouts at world "
            f"{world}: meshsim sweep -n {world} --framework {entry['framework']})"
        )
        keys = Table(header_style="bold", title=None)
        for title in ("config key", "flag", "meaning"):
            keys.add_column(title, no_wrap=title != "meaning")
        for key in entry["config_keys"]:
            keys.add_row(*(escape(str(key[k])) for k in ("key", "flag", "help")))
        out.print(keys)
        kinds = Table(header_style="bold")
        for title in ("kind", "roles", f"in layouts (of {entry['layouts']})", "description"):
            kinds.add_column(title, no_wrap=title != "description")
        for kind in entry["kinds"]:
            # Kind names carry brackets (``hyper_comm_grid[tp]``) that rich reads as markup.
            kinds.add_row(
                escape(kind["name"]),
                ", ".join(kind["roles"]),
                str(kind["layouts"]),
                escape(kind["description"]),
            )
        out.print(kinds)
    return 0


def _all_frameworks() -> list[str]:
    from meshsim.model.conventions import CONVENTIONS

    return list(CONVENTIONS)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
