"""Every python and shell example in README.md and docs/ runs here, so a changed API breaks a
test rather than a reader.

A fenced block is an example when its language is python, py, bash, sh, shell or console. An
HTML comment on the line before the fence says how it runs (tokens separated by commas):

* ``<!-- example: skip (REASON) -->``: not run; the test skips with REASON (a GPU, a cluster,
  an installer). Nothing else may be left unrun.
* ``<!-- example: continue -->``: a python block that goes on from the python block before it
  in the same file (the chain runs as one script).
* ``<!-- example: pytest -->``: a python block that is a test file; it runs under pytest.
* ``<!-- example: slow -->``: minutes of work; runs only with ``-m slow``.
* ``<!-- example: exit N -->``: a shell block whose commands exit N (``meshsim diff`` finding
  a difference exits 1).
* ``<!-- example: torch 2.10 -->``: needs that torch release or a newer one (torchtitan's
  current line builds only from 2.10 on); skipped with that reason on an older one.

A ``meshsim ... --real`` command runs the installed framework: without it the block skips with
meshsim's own reason (the optional extras are not core dependencies).

A shell block runs when every command in it is ``meshsim ...`` or ``python -m meshsim ...``
(``python benchmarks/...`` too, when marked slow); any other command without a skip marker
fails its test, naming the block.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshsim.model import torch_release
from tests.cli.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
#: Importable by the examples: ``my_trainer``, the downstream project of the getting-started test.
SUPPORT = Path(__file__).resolve().parent / "docs"
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell",
             "shell": "shell", "console": "shell"}  # fmt: skip
TIMEOUT_S = 300
#: Slow examples are whole sweeps and benchmarks: minutes each on 2 loaded cores.
TIMEOUT_SLOW_S = 1800

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"<!--\s*example:\s*(?P<spec>.*?)\s*-->")


@dataclass
class Example:
    path: Path
    line: int
    language: str
    code: str
    options: dict[str, str] = field(default_factory=dict)
    #: python blocks this one continues, oldest first (``continue``).
    before: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def _options(spec: str) -> dict[str, str]:
    """``skip (needs a GPU), slow`` -> {"skip": "needs a GPU", "slow": ""}."""
    options: dict[str, str] = {}
    for token in re.split(r",\s*(?![^()]*\))", spec):
        name, _, value = token.strip().partition(" ")
        options[name] = value.strip().strip("()")
    unknown = set(options) - {"skip", "continue", "pytest", "slow", "exit", "torch"}
    if unknown:
        raise ValueError(f"unknown example marker(s) {sorted(unknown)} in {spec!r}")
    return options


def extract(path: Path) -> list[Example]:
    """The examples of one markdown file, in order, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    examples: list[Example] = []
    chain: list[str] = []
    at = 0
    while at < len(lines):
        opening = _FENCE.match(lines[at])
        if not opening:
            at += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = at + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = "\n".join(line[indent:] for line in lines[at + 1 : end]) + "\n"
        language = LANGUAGES.get(opening["lang"].lower())
        if language is not None:
            previous = lines[at - 1] if at else ""
            marker = _MARKER.search(previous)
            options = _options(marker["spec"]) if marker else {}
            example = Example(path, at + 1, language, body, options)
            if language == "python":
                if "continue" in options:
                    example.before = list(chain)
                else:
                    chain = []
                chain.append(body)
            examples.append(example)
        at = end + 1
    return examples


EXAMPLES = [example for source in SOURCES for example in extract(source)]


def _param(example: Example) -> object:
    marks = [pytest.mark.slow] if "slow" in example.options else []
    return pytest.param(example, id=example.id, marks=marks)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(SUPPORT), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def _run(argv: list[str], cwd: Path, example: Example) -> subprocess.CompletedProcess[str]:
    """A ``meshsim`` command runs in this process (``run_cli``: the test worker's torch and
    warm pool); a script, a pytest file or a benchmark in a process of its own."""
    timeout = TIMEOUT_SLOW_S if "slow" in example.options else TIMEOUT_S
    if argv[1:3] == ["-m", "meshsim"]:
        return run_cli(*argv[3:], cwd=cwd)
    try:
        return subprocess.run(
            argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{example.id}: {shlex.join(argv)} ran past {timeout} s")


def _commands(code: str) -> list[list[str]]:
    """Each command of a shell block as argv, comments dropped, ``\\`` lines joined."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


def _argv(command: list[str], example: Example) -> list[str]:
    """A documented command as the argv that runs it here, or a failure naming the block."""
    head, rest = command[0], command[1:]
    if head == "meshsim":
        return [sys.executable, "-m", "meshsim", *rest]
    if head in {"python", "python3"} and rest[:2] == ["-m", "meshsim"]:
        return [sys.executable, *rest]
    if head in {"python", "python3"} and rest[:1] and rest[0].startswith("benchmarks/"):
        if "slow" not in example.options:
            pytest.fail(f"{example.id}: a benchmark command must be marked slow")
        return [sys.executable, *rest]
    pytest.fail(
        f"{example.id}: {shlex.join(command)!r} is neither `meshsim ...` nor "
        "`python -m meshsim ...`; mark the block <!-- example: skip (REASON) --> if it cannot "
        "run in the test suite"
    )


def _framework_missing(argv: list[str]) -> str | None:
    """Why a ``--real`` command cannot run its framework here (None when it can or is no such
    command)."""
    if "--real" not in argv or "meshsim" not in argv[:3]:
        return None
    from meshsim.builders.real import unavailable

    rest = argv[argv.index("meshsim") + 1 :]
    if "--framework" in rest:
        framework = rest[rest.index("--framework") + 1]
    elif len(rest) > 1 and not rest[1].startswith("-"):
        framework = rest[1]
    else:
        return None
    return unavailable(framework)


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path) -> None:
    if "skip" in example.options:
        reason = example.options["skip"]
        if not reason:
            pytest.fail(f"{example.id}: a skip marker needs a reason: skip (needs a GPU)")
        pytest.skip(f"{example.id}: {reason}")
    if "torch" in example.options:
        needed = tuple(int(part) for part in example.options["torch"].split("."))
        have = torch_release.installed()
        if have is not None and have < needed:
            pytest.skip(f"{example.id}: needs torch >= {example.options['torch']}")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    if example.language == "python":
        script = tmp_path / ("test_example.py" if "pytest" in example.options else "example.py")
        script.write_text("".join([*example.before, example.code]), encoding="utf-8")
        if "pytest" in example.options:
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script.name]
        else:
            argv = [sys.executable, script.name]
        runs = [argv]
    else:
        runs = [_argv(command, example) for command in _commands(example.code)]
        assert runs, f"{example.id}: an empty shell block"
        for argv in runs:
            missing = _framework_missing(argv)
            if missing:
                pytest.skip(f"{example.id}: {missing}")
    expected = int(example.options.get("exit") or 0)
    for argv in runs:
        done = _run(argv, tmp_path, example)
        if done.returncode != expected:
            pytest.fail(
                f"{example.id}: {shlex.join(argv[1:])} exited {done.returncode}, "
                f"expected {expected}\n--- stdout\n{done.stdout[-4000:]}\n"
                f"--- stderr\n{done.stderr[-4000:]}"
            )


def test_every_source_is_scanned() -> None:
    """The README and every page are searched; a page moved out of docs/ would not be."""
    assert ROOT / "README.md" in SOURCES
    assert len(SOURCES) > 10


def test_markers_chain_and_fail_closed(tmp_path: Path) -> None:
    """The extractor itself: chains, skip reasons, and a command nobody marked."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- example: continue -->\n```python\nassert x == 1\n```\n\n"
        "<!-- example: skip (needs a GPU), slow -->\n```bash\nnvidia-smi\n```\n\n"
        "```bash\nls -l\n```\n\n```text\nnot an example\n```\n",
        encoding="utf-8",
    )
    first, second, gpu, unmarked = extract(page)
    assert second.before == [first.code] and not first.before
    assert gpu.options == {"skip": "needs a GPU", "slow": ""}
    with pytest.raises(pytest.fail.Exception, match="neither `meshsim"):
        _argv(_commands(unmarked.code)[0], unmarked)
    assert _commands("meshsim show torch \\\n  -n 8  # a comment\n") == [
        ["meshsim", "show", "torch", "-n", "8"]
    ]
