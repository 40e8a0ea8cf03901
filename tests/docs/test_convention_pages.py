"""The generated part of each convention page: every convention has a page, and every page
renders from the code (a convention without a representative config fails here first)."""

from __future__ import annotations

import importlib.util
from html import escape as html_escape
from pathlib import Path
from types import ModuleType

import pytest

import meshsim
from meshsim.model.conventions import convention

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hook", DOCS / "_hooks" / "conventions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOK = _hook()


@pytest.mark.parametrize("framework", list(meshsim.CONVENTIONS))
def test_every_convention_has_a_generated_page(framework: str) -> None:
    page = (DOCS / "conventions" / f"{framework}.md").read_text(encoding="utf-8")
    assert f"<!-- generated: convention {framework} -->" in page
    rendered = HOOK.on_page_markdown(page)
    for key in convention(framework).PARAMETERS:
        assert f"`{key}`" in rendered
    with HOOK.newest_torch():  # what the pages describe, whichever torch is installed
        expected = meshsim.expect(framework, HOOK.WORLD, **HOOK.REPRESENTATIVE[framework])
    for role in expected.roles:
        assert f"`{role}`" in rendered
    assert "<!-- generated" not in rendered


def test_no_page_for_a_convention_that_is_gone() -> None:
    pages = {p.stem for p in (DOCS / "conventions").glob("*.md")} - {"index"}
    assert pages == set(meshsim.CONVENTIONS)


def test_a_cell_shows_its_text_as_written() -> None:
    # A trailing {...} was taken by attr_list as the cell's attributes (torch's `roles` row
    # lost its example), and *x* / _x_ turned into emphasis; code spans stay code.
    text = "e.g. {'tensor': 'tp'} (a*b*c) _f_('x_<n>') [1] a|b & `dp_shard`\nnext"
    assert HOOK._cell(text) == (
        r"e.g. \{'tensor': 'tp'\} (a\*b\*c) \_f\_('x\_&lt;n>') \[1\] a\|b &amp; `dp_shard` next"
    )


def test_every_config_key_description_renders_verbatim() -> None:
    markdown = pytest.importorskip("markdown")  # installed by the docs extra
    convert = markdown.Markdown(extensions=["attr_list", "tables"]).convert
    for framework in meshsim.CONVENTIONS:
        html = convert(HOOK.parameters_table(framework))
        for description in convention(framework).PARAMETERS.values():
            assert f"<td>{html_escape(description, quote=False)}</td>" in html, framework
