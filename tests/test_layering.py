"""Protects the package's layering (docs/design.md §9): no import cycle anywhere in axon4d, and
every module placed in a layer of the import-linter contract that `make test` runs.

Start here when a new module does not fit: put it in the layer whose modules it needs, never
import upwards, and never defer an import to get around a cycle.
"""

from __future__ import annotations

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


def test_every_module_is_in_a_layer():
    placed = _layer_modules()
    graph = _graph()
    loose = [
        m for m in sorted(graph.modules) if m != "axon4d" and not any(m == p or m.startswith(p + ".") for p in placed)
    ]
    assert loose == [], f"modules in no layer of setup.cfg's import-linter contract: {loose}"
