"""The API reference's Sphinx roles (docs/_hooks/sphinx_roles.py): each becomes a code span
inside an optional autorefs link, so the site never shows ``:func:`` raw."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _extension() -> ModuleType:
    path = ROOT / "docs" / "_hooks" / "sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("docs_sphinx_roles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROLES = _extension()


def test_each_role_becomes_an_optional_link_around_code() -> None:
    text = (
        "Runs through :func:`meshsim.run`; returns a :class:`~meshsim.checks.Observation`,\n"
        "see :meth:`ranks`, :py:data:`SURFACE` and :func:`!private` (not linked)."
    )
    resolved = {"ranks": "meshsim.model.mesh_layout.FlatLayout.ranks"}
    assert ROLES.role_links(text, resolved.get) == (
        'Runs through <autoref identifier="meshsim.run" optional>`meshsim.run`</autoref>; '
        'returns a <autoref identifier="meshsim.checks.Observation" optional>`Observation`'
        "</autoref>,\n"
        'see <autoref identifier="meshsim.model.mesh_layout.FlatLayout.ranks" optional>'
        '`ranks`</autoref>, <autoref identifier="SURFACE" optional>`SURFACE`</autoref> '
        "and `private` (not linked)."
    )


def test_an_explicit_title_is_shown_and_the_target_linked() -> None:
    assert ROLES.role_links(":class:`the reference <meshsim.Expected>`") == (
        '<autoref identifier="meshsim.Expected" optional>`the reference`</autoref>'
    )


def test_no_docstring_keeps_a_role_once_the_extension_ran() -> None:
    griffe = pytest.importorskip("griffe")  # installed by the docs extra
    package = griffe.load(
        "meshsim",
        search_paths=[str(ROOT)],
        extensions=griffe.load_extensions(ROLES.SphinxRoles),
    )
    left = [
        obj.path
        for obj in ROLES._objects(package)
        if obj.docstring is not None and re.search(r":[a-z]+:`", obj.docstring.value)
    ]
    assert left == []
    fixture = package["fixtures.distributed_fixture"].docstring.value
    assert '<autoref identifier="meshsim.fixtures.PerRank" optional>`PerRank`</autoref>' in fixture
