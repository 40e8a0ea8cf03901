"""Griffe extension: the Sphinx roles in meshsim's docstrings become code spans that link.

The docstrings name other objects the way Sphinx does (``:func:`meshsim.run```,
``:class:`~meshsim.checks.Observation```, ``:meth:`ranks```), which ``help()`` and IDEs read
well. mkdocstrings' google-style parser knows no roles and would print them raw, so before a
docstring is parsed each role becomes an optional autorefs link around a code span: a link
when the target is documented on the site, plain code when it is not (``optional``: an
unresolved target is no warning, so ``mkdocs build --strict`` stays quiet about names the
reference does not render, such as private helpers). Relative names are resolved in the scope
of the object whose docstring names them, as Sphinx does.

Enabled in mkdocs.yml under the python handler's ``extensions``; the source is left as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

try:  # the docs extra installs griffe; tests/docs imports role_links without it
    from griffe import Extension, NameResolutionError
except ImportError:  # pragma: no cover - role_links needs no griffe
    Extension = object  # type: ignore[assignment,misc]
    NameResolutionError = LookupError  # type: ignore[assignment,misc]

#: The Python-domain roles meshsim's docstrings use (``py:`` prefixed or not).
ROLES = ("func", "class", "meth", "attr", "mod", "data", "exc", "obj", "const", "type")
_ROLE = re.compile(
    r":(?:py:)?(?P<role>" + "|".join(ROLES) + r"):`(?P<body>[^`]+)`",
)
#: ``:role:`title <target>``` (an explicit title, Sphinx's other spelling).
_TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


def role_links(text: str, resolve: Callable[[str], str | None] = lambda name: None) -> str:
    """``text`` with each Sphinx role replaced by an optional autorefs link to a code span.

    ``resolve`` maps a name as written (tilde and leading dots included) to the full path the
    link should point at, or None to link to the name as written. ``~a.b.c`` shows ``c``;
    ``!name`` shows the code without a link, as in Sphinx."""

    def replace(match: re.Match[str]) -> str:
        body = " ".join(match["body"].split())
        titled = _TITLED.match(body)
        title, target = (titled["title"], titled["target"]) if titled else (None, body)
        if target.startswith("!"):
            return _code_span(title or target[1:])
        shown = title or (target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target)
        identifier = resolve(target) or target.lstrip("~.")
        return f'<autoref identifier="{identifier}" optional>{_code_span(shown)}</autoref>'

    return _ROLE.sub(replace, text)


def _code_span(text: str) -> str:
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def resolver(obj: Any) -> Callable[[str], str | None]:
    """Resolve a role's target the way Sphinx does, in the scope of ``obj``'s docstring."""

    def resolve(target: str) -> str | None:
        name = target.lstrip("~")
        if name.startswith("."):  # relative to the module the docstring is in
            module = obj if obj.is_module else obj.module
            package = module if module.is_package else module.parent
            return f"{package.path}{name}" if package is not None else None
        head, _, rest = name.partition(".")
        if head == obj.package.name:  # already a full path
            return name
        try:
            base = obj.resolve(head)
        except NameResolutionError:  # a builtin, or a name the package does not define
            return None
        return f"{base}.{rest}" if rest else base

    return resolve


def _objects(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class SphinxRoles(Extension):  # type: ignore[misc,valid-type]
    """Rewrite every docstring of a package once the whole package is loaded."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = role_links(obj.docstring.value, resolver(obj))
