"""The engine's imports, read from its source with `ast` (every import: module level, inside functions, under
TYPE_CHECKING): no module of northcode/engine/ imports a backend (northcode.torch_backend, northcode.megakernel;
northcode/runtime.py is the one place that names them), and the engine's modules import each other without a
cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "northcode" / "engine"
BACKENDS = ("northcode.torch_backend", "northcode.megakernel")
# Beyond its own modules, the engine may import these (the model's config and code, torch, the stdlib) and nothing
# else of northcode: runtime.py (above the engine) builds engines, and the server loads them through it.
ALLOWED_PREFIXES = ("northcode.engine", "northcode.config", "northcode.model")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, as dotted names."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import of {node.module}"
            modules.add(node.module)
            if node.module == "northcode.engine":  # `from northcode.engine import sampling`
                modules.update(f"northcode.engine.{alias.name}" for alias in node.names)
    return modules


def engine_imports() -> dict[str, set[str]]:
    return {path.stem: imported_modules(path) for path in sorted(ENGINE.glob("*.py"))}


def test_no_engine_module_imports_a_backend_or_anything_above_the_engine():
    imports = engine_imports()
    assert len(imports) >= 10, sorted(imports)
    backends = {(name, m) for name, modules in imports.items() for m in modules if m.startswith(BACKENDS)}
    assert backends == set()
    above = {(name, m) for name, modules in imports.items() for m in modules
             if m.startswith("northcode") and not m.startswith(ALLOWED_PREFIXES)}
    assert not above, above


def test_the_engine_modules_import_each_other_without_a_cycle():
    graph = {name: {m.removeprefix("northcode.engine.") for m in modules if m.startswith("northcode.engine.")}
             for name, modules in engine_imports().items()}
    assert all(target in graph for targets in graph.values() for target in targets), graph
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path[path.index(name):] + [name])}"
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
