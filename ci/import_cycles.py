"""Lists the import circles inside a package, lazy function-level imports included.

Python hides a circle when one side imports inside a function or under `if TYPE_CHECKING:`,
but the two modules still cannot be understood, tested or moved apart; so every `import`
statement counts, wherever it stands. An import of a package counts
as an import of its `__init__.py` only: the implicit import of parent packages would make every
re-exporting `__init__.py` a circle with its own submodules.

Usage: python3 ci/import_cycles.py [PACKAGE_DIR]   (default: meshsim; exits 1 when any circle)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path


def module_files(package_dir: Path) -> dict[str, Path]:
    """Maps each dotted module name under `package_dir` to its file."""
    root = package_dir.parent
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Edges module -> the modules of the same package that it imports."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, path, node)
                # `from pkg import sub` imports the submodule when there is one, else pkg itself.
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that reach each other (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Each circle as the modules of one strongly connected group; empty when there is none."""
    return strongly_connected(import_graph(module_files(package_dir)))


def main(argv: list[str]) -> int:
    package_dir = Path(argv[0] if argv else "meshsim").resolve()
    cycles = import_cycles(package_dir)
    graph = import_graph(module_files(package_dir))
    for group in cycles:
        members = set(group)
        print(" <-> ".join(group))
        for name in group:
            for target in sorted(graph[name] & members):
                print(f"    {name} -> {target}")
    print(f"{len(cycles)} import circle(s) in {package_dir.name}/")
    return 1 if cycles else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
