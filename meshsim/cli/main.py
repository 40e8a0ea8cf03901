"""The ``meshsim`` command: show, diff, verify, sweep and list rank layouts."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from meshsim import options
from meshsim.cli import config_flags as cf
from meshsim.cli import dataflow as dataflow_cli
from meshsim.cli import equivalence as equivalence_cli
from meshsim.cli import outputs, sweep_equivalence
from meshsim.errors import LayoutError, NotEnoughGPUs, UntestedFrameworkWarning, UsageError

VERBS = ("show", "diff", "verify", "sweep", "meshes", "list")
BACKENDS = ("fake", "threaded", "gloo", "nccl")
_BOOLEAN_FLAGS = frozenset(
    {"--json", "--real", "--no-grid", "--cross-check", "-h", "--help", "--version", "--fail-fast"}
    | {"--dataflow", "--equivalence", "--all-kinds", "--independent", "--strict"}
    | {"--all-groups", "--all"}
)

EPILOG = """\
FRAMEWORK's own config flags are listed by: meshsim VERB FRAMEWORK --help (or meshsim list)
--json on every verb: stdout is one JSON object (tables and progress go to stderr) with "verb",
"schema_version" and "exit_code", as meshsim/cli/schemas/VERB.json describes; sweep's --json FILE
writes the same object to FILE instead.
exit codes: 0 ok (diff: layouts agree on every shared role), 1 mismatch (diff: they differ),
2 bad input (unknown framework or flag, invalid config: one line on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _fail(message: str) -> NoReturn:
    sys.stderr.write(
        f"meshsim: error: {message}\n" if not message.startswith("meshsim") else f"{message}\n"
    )
    raise SystemExit(2)


def _positionals(argv: Sequence[str]) -> list[str]:
    """Positional words of argv: not options and not an option's value."""
    out: list[str] = []
    previous = ""
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or _is_number(token):
            takes_value = (
                previous.startswith("-")
                and not _is_number(previous)
                and ("=" not in previous and previous not in _BOOLEAN_FLAGS)
            )
            if not takes_value:
                out.append(token)
        previous = token
    return out


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; each verb's framework-specific flags come from the frameworks in argv."""
    from meshsim import __version__

    parser = _Parser(
        prog="meshsim",
        allow_abbrev=False,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prove parallel-training rank layouts right: show which ranks every group "
        "of a framework holds, diff two layouts, verify live groups against the reference.",
    )
    parser.add_argument("--version", action="version", version=f"meshsim {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    words = _positionals(argv)
    verb = words[0] if words else None
    frameworks = {"diff": words[1:3], "show": words[1:2], "verify": words[1:2]}.get(verb, [])
    if verb == "meshes":
        frameworks = words[1:2]
    for name in frameworks:
        cf.check_framework(cf.split_spec(name)[0] if verb == "diff" else name)

    from meshsim.cli import commands
    from meshsim.cli import sweep as sweeping

    known = ", ".join(_frameworks())

    def sub(
        name: str,
        help_: str,
        run: Callable[[argparse.Namespace], int],
        *,
        framework: bool = True,
        world: bool | None = True,
    ) -> _Parser:
        """A verb's parser: its FRAMEWORK positional and --world-size (required, optional or
        None: not here) first, as every verb's --help lists them."""
        p = verbs.add_parser(
            name,
            help=help_,
            description=help_,
            allow_abbrev=False,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run)
        if framework:
            p.add_argument("framework", metavar="FRAMEWORK", help=f"one of: {known}")
        if world is not None:
            _world(p, required=world)
        return p

    def config_flags(p: _Parser, name: str) -> None:
        """The named frameworks' own flags, only on the verb being parsed (the others' --help
        stays short)."""
        if verb == name and frameworks:
            cf.add_config_flags(p, frameworks)

    show = sub(
        "show",
        "every group kind and role of one framework config: a table, a rank "
        "grid per kind, optionally a picture",
        commands.show,
    )
    show.add_argument(
        "--gpus-per-node",
        type=_positive("--gpus-per-node"),
        metavar="G",
        help="mark groups that span more than one node (node = rank // G)",
    )
    show.add_argument(
        "--svg",
        metavar="FILE",
        help="write a picture, one panel per kind: a cell per rank up to 256 ranks, a cell "
        "per node beyond (G ranks, else 8)",
    )
    show.add_argument(
        "--png", metavar="FILE", help="write the picture as PNG (needs meshsim[plot])"
    )
    show.add_argument(
        "--zoom",
        metavar="START:END",
        help="draw ranks START to END-1 one by one in the picture (at most 256)",
    )
    _json(show)
    show.add_argument(
        "--all-groups",
        action="store_true",
        help="--json lists every group of each kind (default: its structure and the first "
        "--first groups)",
    )
    show.add_argument("--no-grid", action="store_true", help="table only, no rank grids")
    show.add_argument(
        "--kinds",
        action="append",
        metavar="K,K",
        help="only these kinds (or roles), comma separated (repeatable: the kinds add up)",
    )
    show.add_argument(
        "--all-kinds",
        action="store_true",
        help="every kind (torchtitan: each getter call and view dim, not only its axes)",
    )
    show.add_argument(
        "--columns",
        type=_positive("--columns"),
        metavar="C",
        help="ranks per grid row (default: G, else 8/16/32 by world size)",
    )
    show.add_argument(
        "--first",
        type=_positive("--first"),
        default=3,
        metavar="N",
        help="groups listed per kind in the table and --json (default 3)",
    )
    config_flags(show, "show")

    diff = sub(
        "diff",
        "where two conventions (or two configs of one) put different ranks "
        "together for the same degrees, role by role",
        commands.diff,
        framework=False,
        world=None,
    )
    diff.add_argument("a", metavar="A", help="FRAMEWORK[:key=value[:key=value]], e.g. megatron")
    diff.add_argument("b", metavar="B", help="e.g. megatron:order=tp-cp-pp-ep-dp or torchtitan")
    _world(diff)
    for side in ("a", "b"):
        diff.add_argument(
            f"--{side}-set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"a config key for {side.upper()} only (repeatable)",
        )
    for side in ("a", "b"):
        diff.add_argument(
            f"--{side}-order",
            metavar="ORDER",
            help=f"Megatron order for {side.upper()} (= --{side}-set order=..)",
        )
    _json(diff)
    diff.epilog = EPILOG + "\n\n" + DIFF_HELP
    if verb == "diff" and frameworks:
        cf.add_config_flags(diff, [cf.split_spec(f)[0] for f in frameworks], shared_only=True)

    verify = sub(
        "verify",
        "build the framework's groups on N ranks and check every one against "
        "the reference (exit 0 pass, 1 mismatch)",
        commands.verify,
        world=False,
    )
    _tier(
        verify,
        "gloo",
        "fake (no communication), threaded, gloo (default) or nccl",
        "build groups with the real framework (its extra must be installed)",
    )
    _timeout(verify, "seconds before the ranks are stopped (default 120)")
    verify.add_argument(
        "--strict",
        action="store_true",
        help="also fail (exit 1) when the reference layout itself breaks an invariant: the "
        "framework's own rules build a broken layout (a finding, printed either way)",
    )
    _json(verify)
    dataflow_cli.add_flag(verify)
    equivalence_cli.add_flag(verify)
    config_flags(verify, "verify")

    sweep = sub(
        "sweep",
        "verify every valid layout of every (or the given) convention for a world size",
        sweeping.run,
        framework=False,
    )
    sweep.add_argument(
        "--framework",
        action="append",
        metavar="F",
        dest="frameworks",
        help=f"only this convention (repeatable): {known}",
    )
    _tier(
        sweep,
        None,
        f"default {sweeping.SWEEP_BACKEND!r} (gloo with --real; 'reference' above "
        f"{sweeping.planning.LIVE_DEFAULT_MAX_WORLD} ranks): builds and checks every group "
        "of every layout without communicating. threaded and gloo also prove each group by "
        "an all-gather and cost several times more per layout; see --communicate. "
        "'reference' builds nothing: every layout's groups, findings and node placement from "
        "the reference alone (seconds at 1,024 ranks)",
        "build every layout with the installed framework's own code (default: every "
        "framework meshsim has an adapter for and finds installed); the way to put meshsim "
        "in a framework's CI",
        choices=(*BACKENDS, "reference"),
    )
    sweep.add_argument(
        "--communicate",
        type=options.integer("--communicate", minimum=0, error=argparse.ArgumentTypeError),
        default=0,
        metavar="N",
        help="also run N evenly spaced layouts of each convention on threaded and gloo, "
        "proving their groups by real all-gathers, and fail when a tier disagrees (default 0)",
    )
    sweep.add_argument(
        "--exhaustive",
        action="store_true",
        help="build every layout on every rank of the tier; by default a layout whose groups "
        "(kind names aside) an earlier layout of its framework already builds is built on "
        "three fake ranks and diffed against its own reference, and its groups are proven "
        "live once, on the earlier layout (not with --real: the framework's own code is "
        "built in full on the asked tier)",
    )
    sweep.add_argument(
        "--sample",
        type=_positive("--sample"),
        metavar="N",
        help="build only N evenly spaced distinct group structures of each framework live; "
        "the reference still examines every layout (findings, placement)",
    )
    sweep.add_argument(
        "--budget",
        type=options.seconds("--budget", error=argparse.ArgumentTypeError),
        metavar="S",
        help="stop building live layouts after S seconds (the reference step runs first, in "
        "full); the reports hold what was built, complete=false, and exit 0 when it all passed",
    )
    sweep.add_argument(
        "--cross-check",
        action="store_true",
        help="run each layout on fake, threaded and gloo; fail when any tier "
        "observes a different group anywhere",
    )
    _timeout(sweep)
    sweep.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print every result as one JSON object on stdout, or write it to FILE "
        "(also written, marked interrupted, on Ctrl-C or SIGTERM: see below)",
    )
    sweep.add_argument(
        "--junit-xml",
        metavar="FILE",
        help="write a JUnit XML report (also on Ctrl-C or SIGTERM, with an 'interrupted' error)",
    )
    sweep.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    sweep_equivalence.add_flag(sweep)
    sweep.add_argument(
        "--jobs",
        "-j",
        type=_positive("--jobs"),
        default=sweeping.default_jobs(),
        metavar="J",
        help="worker processes for the fake and threaded tiers "
        "(default: one per CPU core, at most 8)",
    )
    sweep.add_argument(
        "--limit",
        type=_positive("--limit"),
        metavar="N",
        help="only the first N layouts of each framework",
    )
    sweep.add_argument(
        "--gpus-per-node",
        type=_positive("--gpus-per-node"),
        metavar="G",
        help="also say, per layout, which kinds have groups spanning more than one node "
        "(node = rank // G); JSON: crosses_nodes, placement",
    )
    sweep.add_argument(
        "--within-node",
        action="append",
        metavar="K,K",
        help="with --gpus-per-node: verify only the layouts whose groups of these kinds or "
        "roles stay inside a node (e.g. tensor,expert or tp,ep; repeatable); the others are "
        "counted as left out",
    )
    sweep.epilog = EPILOG + "\n\n" + SWEEP_HELP

    from meshsim.cli import agreement

    meshes = sub(
        "meshes",
        "check that the meshes one config builds (a dense and an expert mesh, a trainer's "
        "hand-off) agree where they overlap: data ranks, names, communicators",
        agreement.run,
    )
    agreement.add_arguments(meshes)
    config_flags(meshes, "meshes")

    listing = sub(
        "list",
        "the conventions meshsim knows: their config keys (with defaults) and their kinds",
        commands.list_conventions,
        framework=False,
        world=None,
    )
    listing.add_argument(
        "frameworks",
        nargs="*",
        metavar="FRAMEWORK",
        help=f"list these in full: config keys, flags and kinds (default: a line for each "
        f"convention): {known}",
    )
    listing.add_argument(
        "--all",
        action="store_true",
        help="every convention in full (without FRAMEWORK the text is one line a convention; "
        "--json is always in full)",
    )
    _json(listing, "text")
    return parser


DIFF_HELP = """\
how config applies to A and B:
  --tp/--pp/--cp/--dp/--ep/--etp/--dp-replicate/--dp-shard are shared degrees, translated to
  each side's own parameters (tp: megatron tensor_model_parallel_size, deepspeed num_mp,
  torchtitan/olmo-core tp; cp: megatron-deepspeed sequence_parallel_size; torch: a
  (pp, dp, cp, tp) mesh). A framework's own flags (e.g. --order) apply to every side that
  has that parameter. A:key=value, --a-set and --a-order apply to A only (B likewise).
examples:
  meshsim diff megatron megatron:order=tp-cp-pp-ep-dp --world-size 16 --tp 2 --pp 2
  meshsim diff olmo-core torchtitan --world-size 16 --dp-replicate 2 --cp 2"""

SWEEP_HELP = """\
Ctrl-C (SIGINT) or SIGTERM stops a sweep at once: its worker processes are killed with every
process they started, and --json / --junit-xml are still written, marked interrupted, holding
every layout whose result had arrived. Exit 130 after SIGINT, 143 after SIGTERM (128 + the
signal's number, as a shell reports a process killed by it)."""


def _world(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--world-size",
        "-n",
        type=_positive("--world-size"),
        required=required,
        metavar="N",
        help="number of ranks",
    )


def _positive(name: str) -> Callable[[str], int]:
    return options.integer(name, minimum=1, error=argparse.ArgumentTypeError)


def _json(parser: argparse.ArgumentParser, instead: str = "tables") -> None:
    parser.add_argument("--json", action="store_true", help=f"print JSON instead of {instead}")


def _tier(
    parser: argparse.ArgumentParser,
    default: str | None,
    backend_help: str,
    real_help: str,
    choices: Sequence[str] = BACKENDS,
) -> None:
    """--backend and --real: which tier builds the groups, with the verb's own default."""
    parser.add_argument("--backend", choices=choices, default=default, help=backend_help)
    parser.add_argument("--real", action="store_true", help=real_help)


def _timeout(parser: argparse.ArgumentParser, help_: str | None = None) -> None:
    parser.add_argument(
        "--timeout",
        type=options.seconds("--timeout", error=argparse.ArgumentTypeError),
        default=120.0,
        metavar="S",
        help=help_,
    )


def _frameworks() -> list[str]:
    from meshsim.model.conventions import CONVENTIONS

    return list(CONVENTIONS)


def _unknown_flags(
    parser: argparse.ArgumentParser, extras: Sequence[str], words: Sequence[str]
) -> NoReturn:
    """One line for the first flag the verb does not take, with a hint from *this verb's*
    flags only: a flag of another verb (``show --backend``) says which verbs take it, never
    "did you mean --backend?"."""
    flags = [e for e in extras if e.startswith("-") and not _is_number(e)]
    first = (flags or list(extras))[0].split("=")[0]
    verbs = _verb_parsers(parser)
    verb = words[0] if words and words[0] in verbs else None
    own = verbs[verb] if verb else parser
    known = [o for a in own._actions for o in a.option_strings]
    others = [
        name
        for name, sub in verbs.items()
        if name != verb and any(first in a.option_strings for a in sub._actions)
    ]
    close = difflib.get_close_matches(first, known, n=1, cutoff=0.75)
    if verb and others and first.startswith("--"):
        hint = f"; {verb} takes no {first} ({', '.join(others)} do)"
    elif close:
        hint = f"; did you mean {close[0]}?"
    else:
        hint = ""
    _fail(f"unrecognized argument {first!r}{hint} (see meshsim {' '.join(words)} --help)")


def _verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


#: Pairs of flags that choose one thing: given together, one would be ignored.
_EXCLUSIVE = (
    ("kinds", "--kinds", "all_kinds", "--all-kinds", "the kinds shown"),
    ("cross_check", "--cross-check", "backend", "--backend", "the tiers a sweep runs"),
    ("cross_check", "--cross-check", "communicate", "--communicate", "the tiers a sweep runs"),
    ("cross_check", "--cross-check", "sample", "--sample", "the layouts a sweep builds"),
)


def _check_exclusive(args: argparse.Namespace) -> None:
    for first, first_flag, second, second_flag, what in _EXCLUSIVE:
        if getattr(args, first, None) and getattr(args, second, None):
            raise UsageError(
                f"{first_flag} and {second_flag} both choose {what}, and one would be ignored; "
                "give one of them"
            )


def _check_tier(args: argparse.Namespace) -> None:
    """Refuse a tier the machine or the framework cannot run, before any rank starts: nccl
    without a GPU per rank (found in seconds, not after a pool boots), and megatron's own code
    on the fake tier (its gloo groups hit an internal torch assertion there). Where megatron's
    code is not installed it runs nowhere, so the fake tier is no reason to refuse: verify (or
    a sweep that names megatron) names the missing install, the cause; a sweep over every
    framework leaves megatron out."""
    backend = getattr(args, "backend", None)
    if args.verb not in ("verify", "sweep") or backend is None:
        return
    world = args.world_size
    if backend == "reference":
        return
    if world is not None and not (args.verb == "sweep" and args.cross_check):
        from meshsim.harness.api import _check_world_size

        _check_world_size(world, backend)  # the tier's own limit (MESHSIM_MAX_WORLD_SIZE)
    if backend == "nccl" and world is not None:
        from meshsim.harness.nccl import gpu_count

        found = gpu_count()
        if found < world:
            raise NotEnoughGPUs(
                f"--backend nccl with --world-size {world} needs {world} GPUs (one per rank) "
                f"but this machine has {found}; use --backend gloo or threaded"
            )
    if backend == "fake" and args.real:
        if args.verb == "verify":
            gloo = cf.native_settings(args).get("create_gloo_process_groups", True)
            megatron = args.framework == "megatron" and gloo
        else:  # a sweep's megatron layouts keep megatron's default, gloo groups on
            megatron = "megatron" in (args.frameworks or ["megatron"])
        if megatron:
            from meshsim.builders.real import unavailable

            megatron = unavailable("megatron") is None  # find_spec only: nothing imported
        if megatron:
            raise UsageError(
                "--real --backend fake: megatron's own code creates gloo process groups "
                "(create_gloo_process_groups=True), which the fake backend cannot make: torch "
                "fails with an internal assertion; use --backend gloo or threaded (verify: or "
                "--set create_gloo_process_groups=false)"
            )


def _silence_stdout() -> None:
    """After a failed write to stdout, point it at /dev/null: the interpreter's final flush
    of what is still buffered must not fail again with a traceback."""
    with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
    """meshsim's own warnings as one line a user reads; any other as Python shows it."""
    if issubclass(category, UntestedFrameworkWarning):
        sys.stderr.write(f"meshsim: warning: {message}\n")
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshsim`` console script; returns the exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    warnings.showwarning = _show_warning
    try:
        parser = build_parser(args_in)
        args, extras = parser.parse_known_args(args_in)
        if extras:
            words = _positionals(args_in)
            _unknown_flags(parser, extras, words[: 3 if words[:1] == ["diff"] else 2])
        if args.verb is None:
            _fail(f"give a verb: one of {', '.join(VERBS)} (see meshsim --help)")
        # Every check that needs no work runs here, before the verb starts any.
        options.check_environment()
        _check_exclusive(args)
        outputs.check(args)
        _check_tier(args)
        run: Callable[[argparse.Namespace], int] = args.run
        code = run(args)
        sys.stdout.flush()  # a full disk or closed pipe is reported here, not at exit
        return code
    except (LayoutError, UsageError, NotEnoughGPUs) as exc:
        _fail(" ".join(str(exc).split()) or type(exc).__name__)
    except KeyboardInterrupt:
        sys.stderr.write("meshsim: interrupted\n")
        return 130
    except BrokenPipeError:  # `meshsim show ... | head`: stop quietly
        _silence_stdout()
        return 0
    except OSError as exc:  # a report that could not be written: a full disk, a missing folder
        if exc.errno is None:
            raise
        if exc.filename is None:
            _silence_stdout()
        where = "standard output" if exc.filename is None else exc.filename
        _fail(f"cannot write {where}: {exc.strerror or exc}")


def console() -> NoReturn:
    """The ``meshsim`` console script and ``python -m meshsim``: :func:`main`, then an exit
    that skips the interpreter's teardown.

    Why: with torch and a framework loaded and a sweep's results held, freeing every module
    and object at exit took 1.4 to 2 s after the reports were written (a megatron world-8
    sweep of 30 own steps), longer than the 2 s a Ctrl-C is promised for the whole stop.
    What must run at exit still does: other non-daemon threads are joined (after a Ctrl-C or
    SIGTERM for :data:`STOPPED_JOIN_S` at most) and the atexit handlers run (temp dirs,
    worker pools, multiprocess's clean-up), as at a normal exit.
    """
    try:
        code = main()
    except SystemExit as exc:  # _fail, argparse's --help and --version
        code = exc.code
    _exit_now(code)


#: How long a stopped command's exit waits for other non-daemon threads, all together.
STOPPED_JOIN_S = 1.0


def _exit_now(code: int | str | None) -> NoReturn:
    import atexit
    import threading
    import time

    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        sys.stderr.write(f"{code}\n")
        code = 1
    # A stopped run (Ctrl-C: 130, SIGTERM: 143) may leave a thread some framework started deep
    # in a step it was cut out of; its exit waits for such threads a bounded time, not forever.
    patience = STOPPED_JOIN_S if code in (130, 143) else None
    deadline = None if patience is None else time.monotonic() + patience
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing left to tell
            stream.flush()
    os._exit(code or 0)


__all__ = ["build_parser", "console", "main"]
