"""The import graph of ``batchgen`` and ``batchgen_kernels`` (the folder ``kernels/``): no cycle
between modules, and the layers import downwards only (``model/`` and the kernels never import
``engine/``, nothing below the job runner imports ``job/``). Every import counts, at module level or
inside a function. And the import name ``kernels``, Hugging Face's kernel hub's, stays free."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"batchgen": ROOT, "batchgen_kernels": ROOT / "kernels"}  # import name -> folder above it


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p, base): p for pkg, base in PACKAGES.items() for p in (base / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def unit(module: str) -> str:
    """The part of the package a module belongs to: ``batchgen.job.runner`` -> ``batchgen.job``."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_the_parts_of_the_package():
    """Seen as parts (``batchgen.job``, ``batchgen.engine``, ``batchgen.ray_data``, ...), the
    imports run one way: a part never imports one that imports it (the package's own ``__init__``,
    which re-exports the API, aside)."""
    graph: dict[str, set[str]] = {}
    for mod, deps in import_graph().items():
        if mod in PACKAGES:
            continue
        graph.setdefault(unit(mod), set()).update(unit(d) for d in deps if d not in PACKAGES and unit(d) != unit(mod))
    for deps in graph.values():
        deps &= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another():
    """A leading underscore means "this module's own": another module that needs it gets a public
    name in a shared place instead."""
    roots = [base / pkg for pkg, base in PACKAGES.items()] + [ROOT / "scripts"]
    wrong = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}"
        for root in roots
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not wrong, wrong


def test_layers_import_downwards_only():
    forbidden = {
        "batchgen.model": ("batchgen.engine", "batchgen.job", "batchgen.llm"),
        "batchgen_kernels": ("batchgen.engine", "batchgen.job", "batchgen.llm", "batchgen.model"),
        "batchgen.engine": ("batchgen.job", "batchgen.llm"),
        "batchgen.step": ("batchgen.engine", "batchgen.model"),
    }
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in import_graph().items()
        for dep in deps
        for low, above in forbidden.items()
        if (mod == low or mod.startswith(low + ".")) and any(dep == a or dep.startswith(a + ".") for a in above)
    ]
    assert not wrong, wrong


def test_no_top_level_kernels_module():
    """``kernels/`` only holds the package ``batchgen_kernels``: a ``kernels/__init__.py`` (or a
    ``kernels.py``) would shadow Hugging Face's ``kernels`` for every process started here."""
    assert not (ROOT / "kernels" / "__init__.py").exists() and not (ROOT / "kernels.py").exists()
    assert sorted(p.name for p in (ROOT / "kernels").iterdir() if p.name != "__pycache__") == ["batchgen_kernels"]
