"""Helpers: run the ``meshsim`` command the way a user does, and read what it printed.

``run_cli`` runs the command's own entry point (``meshsim.cli.main.main``) inside the test
process by default, with its streams captured and its exit status returned as a subprocess
would: importing torch and booting gloo workers for every command cost most of the CLI tests'
time (two CPU seconds or more per command, far more on a loaded CI machine), while in-process
runs share the test worker's torch and warm worker pool. A test that needs a process of its own
(an environment, an import check, a signal) passes ``env=`` or ``isolated=True``; ``sweep``
always gets one; ``MESHSIM_CLI_SUBPROCESS=1`` runs every command in a subprocess, as before.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: The variables a launched job sets; a command run from a test must not see them.
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    isolated: bool = False,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """``meshsim ARGS`` in ``cwd`` (the repository root); never raises on a non-zero exit.

    In this process unless ``env`` or ``isolated`` asks for a subprocess (``python -m meshsim
    ARGS``). ``timeout`` applies to a subprocess only and only guards against a hang: a loaded
    machine may take minutes to import torch and boot gloo workers, which must not fail a test.
    """
    if env is None and not isolated and not _needs_a_process(args):
        return _in_process(list(args), cwd)
    full_env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    full_env.update({"COLUMNS": "200", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "meshsim", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _needs_a_process(args: tuple[str, ...]) -> bool:
    """``sweep`` starts worker processes (``--jobs``) and takes SIGINT and SIGTERM over while
    it runs: it runs in a subprocess, as a user runs it."""
    return bool(os.environ.get("MESHSIM_CLI_SUBPROCESS")) or "sweep" in args[:1]


def _in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command's entry point here, as ``python -m meshsim`` would run it in ``cwd``: 200
    columns, no job variables; a traceback goes to stderr with exit status 1, as the
    interpreter would print it."""
    from meshsim.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in ("COLUMNS", *_JOB_VARIABLES)}
    saved_cwd = os.getcwd()
    os.environ["COLUMNS"] = "200"
    for name in _JOB_VARIABLES:
        os.environ.pop(name, None)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                if isinstance(exc.code, str):
                    err.write(exc.code + "\n")
            except Exception:
                err.write(traceback.format_exc())
                code = 1
    finally:
        os.chdir(saved_cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["meshsim", *args], code, out.getvalue(), err.getvalue())


def json_of(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def assert_bad_input(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, exactly one line on stderr naming ``needles``, and no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
