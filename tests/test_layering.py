"""Protects the package's layering (docs/design.md §9): no import cycle anywhere in axon4d, and
every module placed in a layer of the import-linter contract that `make test` runs. A package
that groups modules of several layers by idea (``axon4d.comm``, ``axon4d.grid``, …) is in no layer
itself: its ``__init__`` is a docstring that imports nothing, so it can never carry an import
between its modules' layers.

Start here when a new module does not fit: put it in the layer whose modules it needs, never
import upwards, and never defer an import to get around a cycle.
"""

from __future__ import annotations

import ast
import configparser
import os

import grimp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _graph():
    return grimp.build_graph("axon4d", cache_dir=None)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def _layer_modules() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    layers = cfg["importlinter:contract:layers"]["layers"]
    return {m.strip() for line in layers.splitlines() for m in line.split("|") if m.strip()}


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert cycles == [], f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    class Fake:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert _cycles(Fake()) == [["a", "b"]]


def _is_placed(module: str, placed: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in placed)


def _floor_plan_packages(graph, placed: set[str]) -> list[str]:
    """The packages in no layer whose modules all are: they group by idea, not by layer."""
    return sorted(
        m
        for m in graph.modules
        if m != "axon4d"
        and not _is_placed(m, placed)
        and os.path.isfile(os.path.join(ROOT, *m.split("."), "__init__.py"))
        and all(_is_placed(c, placed) for c in graph.find_children(m))
    )


def _imports(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_every_module_is_in_a_layer():
    placed = _layer_modules()
    graph = _graph()
    grouping = set(_floor_plan_packages(graph, placed))
    loose = [m for m in sorted(graph.modules) if m != "axon4d" and m not in grouping and not _is_placed(m, placed)]
    assert loose == [], f"modules in no layer of setup.cfg's import-linter contract: {loose}"


def test_a_package_in_no_layer_imports_nothing():
    """Its ``__init__`` would otherwise import its modules from outside every layer, unchecked."""
    packages = _floor_plan_packages(_graph(), _layer_modules())
    assert "axon4d.comm" in packages and "axon4d.grid" in packages
    importing = {p: _imports(os.path.join(ROOT, *p.split("."), "__init__.py")) for p in packages}
    assert {p: i for p, i in importing.items() if i} == {}


def test_the_top_level_is_a_floor_plan():
    """A handful of modules beside the packages: the public entry points, each one idea."""
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "axon4d")) if f.endswith(".py"))
    assert len(top) <= 12, top
