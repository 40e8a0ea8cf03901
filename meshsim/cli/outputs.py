"""The files a verb writes (``--svg``, ``--png``, ``--json FILE``, ``--junit-xml``): refused up
front when they cannot be written, written whole when they can.

A sweep takes minutes: a typo in ``--json``, two flags naming one file (the second write would
replace the first report) or an SVG under a ``.png`` name must be found before the work, not
after it.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable
from typing import IO, Any

from meshsim.errors import UsageError

#: (argparse dest, flag, the format the flag writes). ``--json`` counts only where it takes a
#: FILE (sweep); elsewhere it is a switch for stdout.
FLAGS = (
    ("svg", "--svg", "SVG"),
    ("png", "--png", "PNG"),
    ("json", "--json", "JSON"),
    ("junit_xml", "--junit-xml", "XML"),
)
#: File name extensions with the format a reader expects under them.
EXTENSIONS = {
    ".svg": "SVG",
    ".png": "PNG",
    ".json": "JSON",
    ".xml": "XML",
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".gif": "GIF",
    ".webp": "WebP",
    ".pdf": "PDF",
    ".html": "HTML",
    ".txt": "text",
}


def given(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(flag, path, format) of every output file the command line names."""
    out = []
    for dest, flag, fmt in FLAGS:
        path = getattr(args, dest, None)
        if isinstance(path, str) and path != "-":
            out.append((flag, path, fmt))
    return out


def check(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the flag, an output path that cannot be written as asked."""
    files = given(args)
    seen: dict[str, str] = {}
    for flag, path, fmt in files:
        _check_one(flag, path, fmt)
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(
                f"{seen[key]} and {flag} {path} name the same file, so one would overwrite the "
                "other; give each its own"
            )
        seen[key] = f"{flag} {path}"


def _check_one(flag: str, path: str, fmt: str) -> None:
    if not path.strip():
        raise UsageError(f"{flag} takes a file name, got {path!r}")
    named = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if named is not None and named != fmt:
        raise UsageError(
            f"{flag} {path}: {flag} writes {fmt}, and a *{os.path.splitext(path)[1]} name says "
            f"{named}; name the file *.{fmt.lower()}"
        )
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK) and not os.path.exists(target):
        raise UsageError(f"{flag} {path}: the directory {folder} is not writable")
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable")
    if _regular(target) or not os.path.exists(target):
        try:
            space = os.statvfs(folder)
        except OSError:
            return
        if space.f_bavail == 0 and space.f_blocks > 0:
            raise UsageError(f"{flag} {path}: the file system holding {folder} is full")


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def write(path: str, fill: Callable[[IO[Any]], None], *, binary: bool = False) -> None:
    """Write a report whole: into ``PATH.partial``, then renamed over ``path``, so a reader
    never sees half a file. A device or pipe (``/dev/stdout``) is written directly: renaming
    onto it would replace the device node with a regular file."""
    mode, encoding = ("wb", None) if binary else ("w", "utf-8")
    direct = os.path.exists(path) and not _regular(path)
    target = path if direct else f"{path}.partial"
    try:
        with open(target, mode, encoding=encoding) as stream:
            fill(stream)
        if not direct:
            os.replace(target, path)
    except OSError as exc:  # a full disk fails in write() or close(), which name no file
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    finally:
        if not direct and os.path.exists(target):
            os.remove(target)
