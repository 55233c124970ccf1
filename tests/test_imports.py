"""The package's imports: no import circles, and no import from a lower layer up into a higher one.

Every module of ``featcache`` is read with ``ast`` (nothing is imported) and its imports become
the edges of a graph between the package's modules. What counts:

- module-level and function-level imports both count for circles: a function-level import only
  postpones the circle to the first call, it does not remove it;
- imports under ``if TYPE_CHECKING:`` never run, so they make no circle; they still count for the
  layers (a type taken from a higher layer is a dependency on it);
- ``from X import name`` is an edge to the module ``X.name`` when there is one, else to ``X``;
- importing ``featcache.a.b`` also runs the ``__init__`` of ``featcache`` and ``featcache.a``: those
  implicit edges are not counted (every package that re-exports its modules would be a circle).

The layers are data (``LAYERS``, bottom first), each a list of module names; a name covers the
module and everything under it (``featcache.tiers`` covers ``featcache.tiers.disk``), but the
root package ``featcache`` covers only its own ``__init__``, and so does a name ending in
``.__init__`` (``featcache.server.__init__``: the package's ``__init__`` alone, where its modules
sit in different layers). A module may import from its own
layer and the layers below it. docs/design.md ("Layers") shows the same table; a test keeps the
two equal.

Written for the package as it grows: ``LAYERS`` may name modules that do not exist (yet, or any
more) without failing; a module it does not cover fails, saying where to place it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "featcache"

# Bottom first. To place a new module: the lowest layer whose modules it needs, here and in
# docs/design.md ("Layers").
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("featcache._version", "featcache.errors", "featcache.sizes", "featcache.keys",
                    "featcache.entrymeta",
                    "featcache.codec", "featcache.config", "featcache.eviction",
                    "featcache.core.hostpool", "featcache.core.copier",
                    "featcache.core.singleflight", "featcache.core.counts", "featcache.autosize",
                    "featcache.threads",
                    "featcache.server.shutdown", "featcache.preprocess")),
    ("LMDB store", ("featcache.store",)),
    ("tiers", ("featcache.tiers",)),
    ("cache", ("featcache.core.__init__", "featcache.core.cache", "featcache.core.chain",
               "featcache.core.lookup", "featcache.core.intake", "featcache.core.writer",
               "featcache.core.demoter",
               "featcache.metrics", "featcache.core.lease", "featcache.core.forks",
               "featcache.keysecret")),
    ("public API", ("featcache",)),
    ("store tools", ("featcache.storetools",)),
    ("lmdeploy integration", ("featcache.lmdeploy",)),
    ("applications", ("featcache.server.__init__", "featcache.server.serve", "featcache.server.report",
                      "featcache.warm", "featcache.demo")),
    ("command line", ("featcache.cli", "featcache.__main__")),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of the package
    line: int
    runs: bool  # False under ``if TYPE_CHECKING:``



# -- reading the package -------------------------------------------------------------------------------
def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root`` (the directory holding it): name -> file."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_in(name: str, path: Path, modules: dict[str, Path], package: str) -> list[Import]:
    """The imports of package modules in module ``name``, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(target: str) -> str | None:
        while target and target not in modules:  # `import featcache.x.y`: the deepest module
            target = target.rpartition(".")[0]
        return target or None

    def add(target: str | None, line: int, runs: bool) -> None:
        if target is not None and (target == package or target.startswith(package + ".")):
            resolved = resolve(target)
            if resolved is not None:
                found.append(Import(name, resolved, line, runs))

    def visit(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runs)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, runs)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source, node.lineno, runs)
        for child in ast.iter_child_nodes(node):
            visit(child, runs)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


# -- the checks ------------------------------------------------------------------------------------------
def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...], package: str) -> set[int]:
    """The indexes of the layers whose names cover ``module`` (one, for a placed module)."""
    found = set()
    for index, (_, names) in enumerate(layers):
        for covered in names:
            if covered.endswith(".__init__"):
                if module == covered.removesuffix(".__init__"):
                    found.add(index)
            elif module == covered or (covered != package and module.startswith(covered + ".")):
                found.add(index)
    return found


def unplaced(modules: dict[str, Path], layers: tuple[tuple[str, tuple[str, ...]], ...],
             package: str) -> list[str]:
    problems = []
    for module, path in modules.items():
        where = layer_of(module, layers, package)
        if len(where) != 1:
            named = ", ".join(repr(layers[i][0]) for i in sorted(where)) or "no layer"
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            problems.append(
                f"{module} ({shown}) is in {named}: place it in exactly one layer of LAYERS in "
                "tests/test_imports.py (the lowest layer that holds what it imports) and in the "
                "table of docs/design.md, 'Layers'")
    return problems


def circles(imports: list[Import]) -> list[list[str]]:
    """Every import circle among the imports that run: one cycle (a -> b -> ... -> a) for each
    strongly connected group of modules."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.runs:
            graph.setdefault(imp.source, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle(graph, group) for group in groups]


def _cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``group`` (breadth first, inside it)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def upward(imports: list[Import], layers: tuple[tuple[str, tuple[str, ...]], ...],
           package: str) -> list[str]:
    """Every import from a lower layer into a higher one, as a message."""
    problems = []
    for imp in imports:
        source, target = layer_of(imp.source, layers, package), layer_of(imp.target, layers, package)
        if len(source) == len(target) == 1 and min(target) > min(source):
            problems.append(
                f"{imp.source} (layer {layers[min(source)][0]!r}) imports {imp.target} (layer "
                f"{layers[min(target)][0]!r}, higher) at line {imp.line}: move what both need "
                "down, or the importer up")
    return problems


def all_imports(modules: dict[str, Path], package: str) -> list[Import]:
    """The imports of every module, each (importer, imported, line) once."""
    found = {imp: None for name, path in modules.items()
             for imp in imports_in(name, path, modules, package)}
    return list(found)


# -- the tests --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def featcache_modules() -> dict[str, Path]:
    modules = package_modules(ROOT, PACKAGE)
    assert len(modules) > 30 and "featcache.core.cache" in modules
    return modules


def test_every_module_is_in_one_layer(featcache_modules):
    problems = unplaced(featcache_modules, LAYERS, PACKAGE)
    assert not problems, "\n".join(problems)


def test_no_import_circles(featcache_modules):
    found = circles(all_imports(featcache_modules, PACKAGE))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_goes_up_a_layer(featcache_modules):
    problems = upward(all_imports(featcache_modules, PACKAGE), LAYERS, PACKAGE)
    assert not problems, "\n".join(problems)


def test_design_doc_shows_the_same_layers():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    shown = [(cells[1], tuple(re.findall(r"`([^`]+)`", cells[2])))
             for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)]
    assert shown == list(LAYERS)


def test_the_checks_find_circles_upward_imports_and_unplaced_modules(tmp_path):
    """The checks above on a made-up package with every problem they look for (so that their
    passing on featcache means something)."""
    files = {
        "pkg/__init__.py": "from .low import thing\n",
        "pkg/low.py": "from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .high import Type\n"  # no circle, but up
                      "def f():\n    from . import mid\n",  # a function-level import
        "pkg/mid.py": "import pkg.low\n",  # with low's function-level import: a circle
        "pkg/high.py": "from pkg import low\nfrom .sub.leaf import x\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "import os\nfrom .. import high\n",  # a circle with high
        "pkg/stray.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    layers = (("bottom", ("pkg.low", "pkg.mid")), ("api", ("pkg",)), ("top", ("pkg.high", "pkg.sub")))
    modules = package_modules(tmp_path, "pkg")
    assert set(modules) == {"pkg", "pkg.low", "pkg.mid", "pkg.high", "pkg.sub", "pkg.sub.leaf",
                            "pkg.stray"}
    imports = all_imports(modules, "pkg")
    assert {(i.source, i.target, i.runs) for i in imports} == {
        ("pkg", "pkg.low", True), ("pkg.low", "pkg.high", False), ("pkg.low", "pkg.mid", True),
        ("pkg.mid", "pkg.low", True), ("pkg.high", "pkg.low", True),
        ("pkg.high", "pkg.sub.leaf", True), ("pkg.sub.leaf", "pkg.high", True)}
    assert sorted(circles(imports)) == [["pkg.high", "pkg.sub.leaf", "pkg.high"],
                                        ["pkg.low", "pkg.mid", "pkg.low"]]
    [up] = upward(imports, layers, "pkg")
    assert up.startswith("pkg.low (layer 'bottom') imports pkg.high (layer 'top', higher) at line 3")
    [stray] = unplaced(modules, layers, "pkg")
    assert stray.startswith("pkg.stray") and "is in no layer: place it in exactly one layer" in stray
    twice = (("a", ("pkg.sub",)), ("b", ("pkg.sub.leaf", "pkg.low", "pkg.mid", "pkg.high", "pkg.stray")),
             ("c", ("pkg",)))
    [leaf] = unplaced(modules, twice, "pkg")
    assert leaf.startswith("pkg.sub.leaf") and "is in 'a', 'b': place it" in leaf
    split = (("a", ("pkg.sub.leaf", "pkg.low", "pkg.mid", "pkg.stray")), ("b", ("pkg",)),
             ("c", ("pkg.sub.__init__", "pkg.high")))  # a package's __init__ alone
    assert unplaced(modules, split, "pkg") == []
    assert layer_of("pkg.sub", split, "pkg") == {2} and layer_of("pkg.sub.leaf", split, "pkg") == {0}
