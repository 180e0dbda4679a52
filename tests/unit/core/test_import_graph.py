"""No import cycles: between modules of model/, pipeline/ and workflows/, and between pipeline's
subpackages and core modules (pipeline.train, pipeline.decoding, pipeline.config, ...).

The graph is grimp's (the library import-linter runs on): imports inside functions count. The
layers themselves are import-linter's contracts (pyproject.toml, ``lint-imports``); this test
finds the cycles a layers contract would let through (inside one layer, e.g. within pipeline.train,
or among the core modules, one non-independent layer) and names one.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

import grimp
import pytest

ROOTS = ("model", "pipeline", "workflows")


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*ROOTS, include_external_packages=False, cache_dir=None)


def _edges(graph, node_of: Callable[[str], str]) -> dict[str, set[str]]:
    """importer -> imported, over ``node_of`` of each module (self-imports of a node dropped)."""
    out: dict[str, set[str]] = {}
    for module in graph.modules:
        a = node_of(module)
        out.setdefault(a, set())
        for imported in graph.find_modules_directly_imported_by(module):
            b = node_of(imported)
            if a != b:
                out[a].add(b)
    return out


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def _cycle(edges: dict[str, set[str]], members: Iterable[str]) -> list[str]:
    """One shortest cycle through the first member of a component: a -> b -> ... -> a."""
    members = set(members)
    start = min(members)
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges.get(node, ())):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return list(reversed(path)) + [start]
            if child in members and child not in previous:
                previous[child] = node
                queue.append(child)
    return sorted(members)


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    return [" -> ".join(_cycle(edges, c)) for c in _components(edges) if len(c) > 1]


def _subpackage(module: str) -> str:
    """pipeline.train.loop -> pipeline.train; pipeline.config -> pipeline.config; others as they are."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 1 else module


def test_the_graph_covers_the_project(graph):
    # A wrong root or an import-time failure would leave an empty graph and a vacuous pass.
    for module in ("model", "pipeline.dag", "pipeline.decoding.translator", "pipeline.train.driver",
                   "workflows.runner"):
        assert module in graph.modules
    # a function-level import is an edge too (the runner imports the bill inside format_bill)
    assert "pipeline.plan.train_bill" in graph.find_modules_directly_imported_by("workflows.runner")


def test_no_import_cycle_between_modules(graph):
    cycles = _cycles(_edges(graph, lambda m: m))
    assert not cycles, "import cycle(s) between modules:\n" + "\n".join(cycles)


def test_no_import_cycle_between_pipeline_subpackages(graph):
    edges = _edges(graph, _subpackage)
    pipeline_only = {a: {b for b in bs if b.startswith("pipeline.")} for a, bs in edges.items()
                     if a.startswith("pipeline.")}
    cycles = _cycles(pipeline_only)
    assert not cycles, "import cycle(s) between pipeline's subpackages:\n" + "\n".join(cycles)


def test_the_cycle_finder_finds_and_names_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": set()}
    assert _cycles(edges) == ["a -> b -> c -> a"]
    assert _cycles({"x": {"y"}, "y": set()}) == []
