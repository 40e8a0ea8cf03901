"""The generated part of each convention page: every convention has a page, and every page
renders from the code (a convention without a representative config fails here first)."""

from __future__ import annotations

import importlib.util
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
