"""The house's import rules, read from the source with `ast` (every import counts: module level,
inside functions and under TYPE_CHECKING, since a lazy import is a dependency all the same):
no import circle anywhere in app/, and data flows one way, web -> decisions -> engine."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in APP.rglob("*.py")}


def imported(path: Path) -> set[str]:
    """The app modules `path` imports (a `from package import name` that names a submodule counts
    as that submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES and MODULES[name].name != "__init__.py"}


GRAPH = {name: imported(path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_the_app():
    assert "app.decisions.run" in GRAPH and "app.engine.base" in GRAPH["app.decisions.run"]


def test_no_import_circle_in_app():
    assert cycles(GRAPH) == []


def within(prefix: str) -> dict[str, set[str]]:
    return {name: targets for name, targets in GRAPH.items() if name == prefix or name.startswith(prefix + ".")}


def test_the_decision_core_imports_only_the_engine_contract():
    for name, targets in within("app.decisions").items():
        outside = {t for t in targets if not t.startswith("app.decisions")}
        assert outside <= {"app.engine.base"}, (name, outside)


def test_the_engines_import_neither_the_web_nor_the_decisions_nor_the_settings():
    for name, targets in within("app.engine").items():
        assert not {t for t in targets if t.startswith(("app.web", "app.decisions", "app.config", "app.build"))}, name


def test_each_engine_package_keeps_to_itself():
    for name, targets in within("app.engine.hf").items():
        assert not {t for t in targets if t.startswith("app.engine.vllm")}, name
    for name, targets in within("app.engine.vllm").items():
        assert not {t for t in targets if t.startswith("app.engine.hf")}, name


def test_the_settings_depend_on_nothing_they_configure():
    assert not {t for t in GRAPH["app.config"] if t.startswith(("app.decisions", "app.engine", "app.web"))}


def test_the_web_never_imports_the_server():
    for name, targets in within("app.web").items():
        assert "app.server" not in targets, name
