"""Where in the user's code a rank stands: the file:line reports name instead of internals.

A report that says "step 43" or shows 12 frames of torch makes the reader dig; the line of
their own code that made the call (or that a rank is stuck on) is what they need. A *site*
is the innermost frame outside meshsim, torch and the standard library: the body's own line,
or the line of a library it uses (Megatron, verl) that issued the call. The recorder takes it
off the live stack when a call is made; the timeout report reads it off a rank's stack text,
which is either ``traceback`` style (the threaded and fake tiers, most recent call last) or
``faulthandler`` style (process tiers, most recent call first, no source), so both name the
same line. Pure: no torch import, the torch directory is found without importing it.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import sysconfig
from types import FrameType

#: A frame line in either stack format: ``File "x.py", line 3, in f`` / ``File "x.py", line 3
#: in f`` (faulthandler has no comma).
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>.+?)\s*$')

Site = tuple[str, int]


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "")


def _internal_prefixes() -> tuple[str, ...]:
    meshsim_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
    prefixes = [meshsim_dir]
    torch_dir = _package_dir("torch")
    if torch_dir:
        prefixes.append(torch_dir)
    return tuple(prefixes)


_INTERNAL: tuple[str, ...] | None = None
_STDLIB = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")})
_verdicts: dict[str, bool] = {}


def is_internal(path: str) -> bool:
    """True for meshsim's, torch's and the standard library's files (not site-packages)."""
    verdict = _verdicts.get(path)
    if verdict is None:
        global _INTERNAL
        if _INTERNAL is None:
            _INTERNAL = _internal_prefixes()
        verdict = (
            path.startswith("<frozen")
            or path == "<string>"
            or path.startswith(_INTERNAL)
            or (
                path.startswith(_STDLIB)
                and "site-packages" not in path
                and "dist-packages" not in path
            )
        )
        _verdicts[path] = verdict
    return verdict


def call_site(frame: FrameType | None) -> Site | None:
    """The innermost user frame at or above ``frame`` (``None`` when every frame is internal)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_internal(path):
            return (path, frame.f_lineno)
        frame = frame.f_back
    return None


def stack_sites(text: str) -> list[tuple[str, int, str]]:
    """The (path, line, function) frames of one thread's stack text, innermost last.

    ``text`` is a ``traceback.format_stack`` or a ``faulthandler`` dump; of a dump with
    several threads the last block is taken (faulthandler lists the oldest thread, the one
    that runs the body, last).
    """
    blocks = [
        b
        for b in re.split(r"\n\s*\n", text.strip())
        if any(_FRAME.match(line) for line in b.splitlines())
    ]
    if not blocks:
        return []
    block = blocks[-1]
    frames = [
        (m["path"], int(m["line"]), m["func"])
        for m in (_FRAME.match(line) for line in block.splitlines())
        if m is not None
    ]
    if "most recent call first" in block:
        frames.reverse()
    return frames


def as_traceback(dump: str) -> str:
    """A ``faulthandler`` dump rewritten as ``traceback.format_stack`` writes a stack.

    Most recent call last, each frame with its source line (read here, as ``traceback``
    does), so a process rank's stack reads like a thread rank's. With several threads, each
    keeps a ``Thread 0x...:`` line, the body's thread last. Text that is not a dump is kept.
    """
    blocks = re.split(r"\n\s*\n", dump.strip())
    several = sum(1 for b in blocks if any(map(_FRAME.match, b.splitlines()))) > 1
    out: list[str] = []
    for block in blocks:
        lines = block.splitlines()
        frames = [m for m in (_FRAME.match(line) for line in lines) if m is not None]
        if not frames:
            out.append(block.strip() + "\n")
            continue
        if "most recent call first" in block:
            frames.reverse()
        text = ""
        head = lines[0].strip()
        if several and head.startswith(("Thread ", "Current thread ")):
            text += head.split(" (most recent", 1)[0] + ":\n"
        for m in frames:
            text += f'  File "{m["path"]}", line {m["line"]}, in {m["func"]}\n'
            code = linecache.getline(m["path"], int(m["line"])).strip()
            if code:
                text += f"    {code}\n"
        out.append(text)
    return "\n".join(out)


def stack_site(text: str | None) -> Site | None:
    """The innermost user frame of a stack text (see ``stack_sites``), if any."""
    if not text:
        return None
    for path, line, _ in reversed(stack_sites(text)):
        if not is_internal(path):
            return (path, line)
    return None


def format_site(site: Site, *, source: bool = False) -> str:
    """``tests/test_x.py:12`` (relative to the working directory when under it).

    ``source``: add the line's text, ``tests/test_x.py:12 (time.sleep(1))``, read here from
    the file, so every tier shows it whether its stacks carry source or not.
    """
    path, line = site
    shown = path
    if os.path.isabs(path):
        cwd = os.path.join(os.getcwd(), "")
        if path.startswith(cwd):
            shown = path[len(cwd) :]
        elif "-packages" + os.sep in path:
            shown = path.rsplit("-packages" + os.sep, 1)[1]
    text = f"{shown}:{line}"
    if source:
        code = linecache.getline(path, line).strip()
        if code:
            text += f" ({code})"
    return text
