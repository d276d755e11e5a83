"""The package's shape: imports flow one way (headstart.train -> headstart.heads, headstart.inference ->
headstart.heads), with no cycle.

Every `import` statement counts, module level or inside a function: a cycle hidden in a function body is
still a cycle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "train", "inference")


def module_name(path: Path) -> str:
    """heads/load.py -> headstart.heads.load (the installed name of a repo file)."""
    return "headstart." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 15  # the walk found the modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_imports_flow_one_way():
    """heads/ is the base; inference/ never imports train/ (train may import inference to evaluate)."""
    for module, imports in import_graph().items():
        if module.startswith("headstart.heads"):
            assert not {i for i in imports if not i.startswith("headstart.heads")}, (module, imports)
        if module.startswith("headstart.inference"):
            assert not {i for i in imports if i.startswith("headstart.train")}, (module, imports)
