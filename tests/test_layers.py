"""The house: imports run one way. Every import between batchctl's modules (at module level,
inside functions, under TYPE_CHECKING) is an edge; a cycle fails here, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchctl"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "batchctl":
                for alias in node.names:  # `from batchctl import format` imports the submodule
                    submodule = f"{node.module}.{alias.name}"
                    graph[name].add(submodule if submodule in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in mods)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_imports_run_one_way() -> None:
    assert [" -> ".join(cycle) for cycle in cycles(import_graph())] == []


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_shared_records_sit_at_the_bottom() -> None:
    graph = import_graph()
    assert graph["batchctl.records"] == set() and graph["batchctl.report"] == set()
    assert graph["batchctl.errors"] <= {"batchctl.report"}  # BuildFailed carries the report
