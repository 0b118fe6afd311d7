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


# The folders are the layers; a module imports only from its own folder or from a lower layer.
LAYERS = {
    "__main__": 5, "batchctl": 5, "cli": 5,  # entry points
    "torch": 5, "torch_ring": 5, "torch_state": 5,  # the PyTorch adapter (torch_ring, torch_state: its own parts)
    "build": 4,  # the public build API: plans a build's start, runs an engine, publishes
    "prepare": 3, "publish": 3,  # the facts a start is planned from and the work folder set up; publishing
    "run": 2, "plan": 2, "read": 2,  # the processes of a build; what to build; reading a dataset
    "preprocess": 1, "store": 1, "progress": 1,  # per-file functions; the on-disk format and storage
    "records": 0, "errors": 0, "report": 0, "version": 0, "synthetic": 0,  # shared types, test data
}  # fmt: skip


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward(source: int, target: int) -> bool:
    """An import that does not go down; within the top and the bottom layer (single modules, not
    folders) imports go sideways too, and the cycle test keeps them one way."""
    return target > source or (target == source and source not in (0, max(LAYERS.values())))


def test_the_folders_are_layers_imported_downwards() -> None:
    graph = import_graph()
    assert {layer_of(name) for name in graph} <= set(LAYERS), "a new top-level module needs a layer"
    upward = [
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if layer_of(name) != layer_of(target) and _upward(LAYERS[layer_of(name)], LAYERS[layer_of(target)])
    ]
    assert upward == []
