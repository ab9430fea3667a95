"""The import graph of the product packages (``moejax``, ``serving``, ``kernels_pallas``):
no cycle, no private name imported from another module, and ``serving`` (the front:
requests, CLI, gRPC) compiles nothing: every ``jax.jit`` is in the engine (``moejax``).

An edge A -> B is any import of B in A's source: at module level or inside a function (a
lazy import is still a dependency; hiding a cycle in a function does not remove it),
except under ``if TYPE_CHECKING:``. ``from pkg import sub`` of a submodule is an edge to
``pkg.sub`` only: a module reaching a sibling through its package is not a dependency on
the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moejax", "serving", "kernels_pallas")


# ----------------------------------------------------------------------------- scanner
def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: set[str]) -> str | None:
    """The product module an imported dotted name lives in (None: not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _base(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False
               ) -> list[tuple[str, list[str]]]:
    """(imported product module, names taken from it) of every import in ``source``."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                owner = _owner(alias.name, modules)
                if owner:
                    found.append((owner, []))
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.append((submodule, []))
                elif (owner := _owner(base, modules)) is not None:
                    found.append((owner, [alias.name]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    names = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = imports_of(module, path.read_text(encoding="utf-8"), names,
                           path.name == "__init__.py")
        graph[module] = {target for target, _ in edges if target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


# ----------------------------------------------------------------------------- the scanner
def test_the_scanner_sees_lazy_relative_and_submodule_imports():
    modules = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d"}
    source = ("from typing import TYPE_CHECKING\n"
              "import os\n"
              "from p import b\n"                    # a submodule: an edge to p.b only
              "from p.c import thing\n"
              "if TYPE_CHECKING:\n    from p.sub import d\n"
              "def f():\n    from .sub.d import _hidden\n")
    assert imports_of("p.a", source, modules) == [("p.b", []), ("p.c", ["thing"]),
                                                   ("p.sub.d", ["_hidden"])]
    assert imports_of("p.sub", "from . import d\nfrom .. import a\n", modules,
                      is_package=True) == [("p.sub.d", []), ("p.a", [])]


def test_cycles_finds_each_strongly_connected_component():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"},
             "g": {"g"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# ----------------------------------------------------------------------------- the product
@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    found = module_files()
    assert {"moejax.model", "serving.cli", "kernels_pallas.gmm"} <= set(found)
    return found


def test_no_import_cycle_among_the_product_packages(modules):
    found = cycles(import_graph(modules))
    assert found == [], "import cycles (each a strongly connected component): " + "; ".join(
        " <-> ".join(component) for component in found)


def test_no_private_name_is_imported_from_another_module(modules):
    names = set(modules)
    offending = []
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        for target, taken in imports_of(module, source, names, path.name == "__init__.py"):
            offending += [f"{module} imports {target}.{name}" for name in taken
                          if name.startswith("_") and not name.startswith("__")
                          and target != module]
    assert offending == []


def _jit_calls(source: str) -> list[int]:
    """Lines of ``jax.jit(...)``/``@jax.jit``/``jax.pmap``, or of a ``jit`` taken from jax."""
    tree = ast.parse(source)
    local = {alias.asname or alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax")
             for alias in node.names if alias.name in ("jit", "pmap")}
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("jit", "pmap")
                and isinstance(node.value, ast.Name) and node.value.id == "jax"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in local and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_jit_scanner():
    assert _jit_calls("import jax\nf = jax.jit(g)\n@jax.jit\ndef h(): pass\n") == [2, 3]
    assert _jit_calls("from jax import jit as J\nJ(f)\n") == [2]
    assert _jit_calls("import jax\njax.numpy.sum(x)\njit = 1\n") == []


def test_serving_compiles_nothing(modules):
    offending = [f"{path.relative_to(ROOT)}:{line}" for module, path in modules.items()
                 if module.startswith("serving")
                 for line in _jit_calls(path.read_text(encoding="utf-8"))]
    assert offending == [], "serving/ must leave compiling to the engine (moejax/)"
