"""No test reads a private name: every check goes through what the code offers its callers (public
functions, read-only properties, `stats` counters). A test that needs to see more asks the code for a
public, documented view of it. Every tests/**/*.py file is parsed with `ast` (and every multi-line
string in it that parses as Python: code run in a subprocess) and refused for:

- an attribute access `x._name` (one leading underscore; dunders are fine),
- `from m import _name`, or an import of a module path with a `_part`,
- a name given as a string: `getattr`/`setattr`/`hasattr`/`delattr` (monkeypatch's too) with
  "_name", or a dotted target into the project such as "app.cli._helper",
- a keyword argument `_name=` (a stand-in object built with a private attribute for the code to read).

Only the other projects' names in ALLOWED may be read, each for the reason given there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Private names of other projects that tests may read (dotted prefixes), and why.
ALLOWED = {
    "torch._dynamo": "torch.compile's counters and per-thread limits have no public API",
    "os._exit": "the standard library's documented exit without clean-up (the fake upstream dies mid-request)",
}

# Where a dotted name given as a string points into the project.
PROJECT_ROOTS = frozenset({"app", "bench", "scripts", "tests", "djev_vllm_patch"})
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
BY_NAME = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def allowed(dotted: str) -> bool:
    return any(dotted == prefix or dotted.startswith(prefix + ".") for prefix in ALLOWED)


def private_path(dotted: str) -> bool:
    return any(private(part) for part in dotted.split(".")) and not allowed(dotted)


def private_reads(source: str, where: str = "<source>") -> list[str]:
    """Every private read in `source`, as "where:line: what"."""
    found: list[str] = []

    def note(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            text = ast.unparse(node)
            if not allowed(text):
                note(node, text)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                if private_path(f"{module}.{alias.name}" if module else alias.name):
                    note(node, f"from {'.' * node.level}{module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if private_path(alias.name):
                    note(node, f"import {alias.name}")
        elif isinstance(node, ast.Call):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
            if name in BY_NAME and len(node.args) > 1:
                target = node.args[1]
                if isinstance(target, ast.Constant) and isinstance(target.value, str) and private(target.value):
                    note(node, f"{name}(..., {target.value!r})")
        elif isinstance(node, ast.keyword) and node.arg is not None and private(node.arg):
            note(node, f"{node.arg}=")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if DOTTED.fullmatch(text) and text.split(".")[0] in PROJECT_ROOTS and private_path(text):
                note(node, repr(text))
            elif "\n" in text:
                try:
                    found += private_reads(text, f"{where}:{node.lineno} (code in a string)")
                except SyntaxError:
                    pass  # prose
    return found


def test_no_test_reads_a_private_name():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += private_reads(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, "tests read private names (give the code a public, documented view instead):\n" + \
        "\n".join(found)


def test_the_guard_sees_each_kind_of_private_read():
    reads = ['reader._queue', 'runner.prefixes._items.values()', 'from app.cli import _gpu_available',
             'import app._hidden', 'monkeypatch.setattr("app.cli._gpu_available", f)',
             'monkeypatch.setattr(refusals, "_lookup", f)', 'getattr(builder, "_mark", False)',
             'run_python("import m\\nm.builder._mark\\n")', 'model.config._experts_implementation',
             'SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))']
    for read in reads:
        assert private_reads(read), read
    fine = ['reader.stats["queue_depth"]', 'x.__class__', 'from __future__ import annotations',
            'import torch._dynamo.utils', 'torch._dynamo.config.recompile_limit', 'os._exit(3)',
            'monkeypatch.setattr("torch.cuda.is_available", f)', 'name.endswith("_s")']
    for read in fine:
        assert not private_reads(read), read
