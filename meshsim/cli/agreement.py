"""The ``meshes`` verb: do the meshes one framework config builds agree where they overlap?

Without ``--backend`` the reference's meshes (``Expected.layout`` as ``main`` and
``Expected.meshes``) are compared on every rank; with one, the framework's builder builds its
meshes live on that tier (its ``meshes(world_size, config)``) and every rank compares its own,
communicators and mesh equality included.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from meshsim.checks.agreement import Disagreement, check_meshes
from meshsim.cli import config_flags as cf
from meshsim.cli import render
from meshsim.errors import UsageError
from meshsim.model.conventions import expect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--same",
        action="append",
        default=[],
        metavar="MESH:DIM=MESH:DIM",
        help="two dims that are one group on purpose (repeatable), e.g. main:fsdp=trainer:dp_shard",
    )
    parser.add_argument(
        "--data-dims",
        action="append",
        default=[],
        metavar="MESH=DIM[,DIM]",
        help="the dims whose coordinate is MESH's data rank (MESH= for none); default: dims "
        "named dp/dp_replicate/dp_shard/fsdp/ddp/..., none in a mesh with an expert dim",
    )
    parser.add_argument(
        "--independent",
        action="store_true",
        help="the meshes serve different models: they must not share a communicator",
    )
    parser.add_argument(
        "--backend",
        choices=("fake", "threaded", "gloo"),
        help="build the meshes live with the framework's builder on this tier (default: compare "
        "the reference's meshes)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def rules_from(args: argparse.Namespace) -> dict[str, Any]:
    """``--same`` / ``--data-dims`` / ``--independent`` as ``check_meshes`` keywords."""
    same = []
    for text in args.same:
        a, sep, b = text.partition("=")
        if not sep or ":" not in a or ":" not in b:
            raise UsageError(f"--same takes MESH:DIM=MESH:DIM, got {text!r}")
        same.append((a.strip(), b.strip()))
    data: dict[str, tuple[str, ...]] = {}
    for text in args.data_dims:
        mesh, sep, dims = text.partition("=")
        if not sep or not mesh:
            raise UsageError(f"--data-dims takes MESH=DIM[,DIM] (or MESH=), got {text!r}")
        data[mesh.strip()] = tuple(d.strip() for d in dims.split(",") if d.strip())
    return {"data_dims": data, "same_groups": same, "independent": args.independent}


def run(args: argparse.Namespace) -> int:
    config = cf.config_for(
        args.framework, args.world_size, cf.native_settings(args), cf.shared_degrees(args)
    )
    expected = expect(args.framework, args.world_size, **config)
    names = ["main", *expected.meshes]
    rules = rules_from(args)
    if args.backend is None:
        if len(names) < 2:
            raise UsageError(
                f"{args.framework} builds one mesh for this config ({render.config_text(config)}); "
                "there is nothing to compare"
            )
        found = check_meshes(expected, **rules)
    else:
        found = _live(args.framework, args.world_size, config, args.backend, rules)
    return _report(args, names, found)


def _live(
    framework: str,
    world_size: int,
    config: Mapping[str, Any],
    backend: str,
    rules: Mapping[str, Any],
) -> list[Disagreement]:
    from meshsim.builders import builder
    from meshsim.harness import run as run_ranks

    module = builder(framework)
    if not hasattr(module, "meshes"):
        raise UsageError(
            f"meshsim's {framework} builder does not hand out its meshes; drop --backend to "
            "compare the reference's"
        )

    def body() -> list[Disagreement]:
        meshes = module.meshes(world_size, dict(config))
        return check_meshes(meshes, framework=framework, **rules)

    per_rank = run_ranks(body, world_size, backend=backend)
    return [d for found in per_rank for d in found]


def _report(args: argparse.Namespace, names: Sequence[str], found: list[Disagreement]) -> int:
    code = 1 if found else 0
    if args.json:
        render.print_json(
            {
                "verb": "meshes",
                "schema_version": render.JSON_SCHEMA_VERSION,
                "exit_code": code,
                "framework": args.framework,
                "world_size": args.world_size,
                "meshes": list(names),
                "backend": args.backend or "reference",
                "disagreements": [
                    {"rank": d.rank, "meshes": d.meshes, "aspect": d.aspect, "detail": d.detail}
                    for d in found
                ],
            }
        )
        return code
    out = render.console()
    where = f"live on {args.backend}" if args.backend else "in the reference"
    if not found:
        out.print(f"meshes {', '.join(names)} agree on every rank ({where})")
        return 0
    from meshsim.checks.agreement import summary

    out.print(f"[bold]meshes disagree ({where}): {len(found)} finding(s)[/bold]")
    out.print(summary(found, first=10), markup=False)
    return 1
