"""No module of meshsim imports another that imports it back (ci/import_cycles.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _import_cycles_module() -> ModuleType:
    # ci/ is no package: load the script by path, as CI runs it.
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "ci" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cycles = _import_cycles_module()


def test_finds_a_lazy_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert cycles.import_cycles(package) == [["pkg.a", "pkg.b"]]


def test_model_and_builders_have_no_import_circle() -> None:
    found = cycles.import_cycles(ROOT / "meshsim")
    inside = [
        group
        for group in found
        if any(m.startswith(("meshsim.model", "meshsim.builders")) for m in group)
    ]
    assert inside == []


def test_meshsim_has_no_import_circle() -> None:
    assert cycles.import_cycles(ROOT / "meshsim") == []
