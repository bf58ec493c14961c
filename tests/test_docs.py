"""The docs cite only what the repository holds: every repository path they name exists, no file
points outside the repository, and every raw result under docs/results/ is cited by some doc."""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The top-level folders whose paths the docs cite.
TOP = ("app", "tests", "bench", "scripts", "docs", "patches", "constraints", "docker", "deploy")

# A path starts at one of those folders, not inside a longer path (`/tmp/bench_x.json`,
# `~/.cache/djev-bench/`) or a dotted name; it runs on over path characters and `{a,b}` braces.
PATH = re.compile(r"(?<![\w./~-])(?:" + "|".join(TOP) + r")/[\w.{},*?/-]*")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
# A file named without its folder (`test_remote.py`, a module map's `reader.py`).
BARE = re.compile(r"(?<![\w./~{,-])[\w-]+\.(?:py|md|sh|json|log|txt|toml|yaml|yml|js|css|html)\b(?![\w/(])")
# Files the docs name that belong to a model checkpoint, not to this repository.
NOT_OURS = {"config.json"}

# Places outside the repository that no file may cite (written so that this file does not cite them).
OUTSIDE = re.compile(r"(?<![\w.-])(?:shared[/]|seeds[/])|/work[/]")
UP = re.compile(r"(?<![\w.])(?:\.\.[/])+[\w.-]*")


def docs() -> dict[str, str]:
    """The docs by their repository path: the README, docs/*.md, the patches' README, and the bench
    scripts' module docstrings (they cite results and commands)."""
    files = [ROOT / "README.md", ROOT / "patches" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {f.relative_to(ROOT).as_posix(): f.read_text() for f in files}
    for script in sorted((ROOT / "bench").glob("*.py")):
        texts[script.relative_to(ROOT).as_posix()] = ast.get_docstring(ast.parse(script.read_text())) or ""
    return texts


def repository_files() -> list[Path]:
    """Every file git tracks or would track (ignored files left out)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def tracked_text_files() -> list[Path]:
    """Every repository file that is text, but the raw results themselves."""
    files = []
    for path in repository_files():
        if path.relative_to(ROOT).as_posix().startswith("docs/results/"):
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def expand(token: str) -> list[str]:
    """`docs/results/x.{log,json}` -> both names; a path without braces as it is."""
    parts = re.split(r"(\{[^{}]*\})", token)
    options = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
    return ["".join(choice) for choice in itertools.product(*options)]


def cited_paths(text: str) -> list[str]:
    """The repository paths a text names: URLs and globs left out, trailing punctuation trimmed."""
    text = URL.sub(" ", text)
    paths = []
    for match in PATH.finditer(text):
        token = match.group(0).rstrip(".,:;")
        if "{" in token and "}" not in token:
            continue  # a brace cut off by the pattern: not a path
        for path in expand(token):
            path = path.rstrip(".,:;")
            if "*" in path or "?" in path:
                continue
            paths.append(path)
    return paths


def test_every_cited_path_exists():
    missing = []
    for doc, text in docs().items():
        for number, line in enumerate(text.splitlines(), 1):
            for path in cited_paths(line):
                if not (ROOT / path).exists():
                    missing.append(f"{doc}:{number}: {path}")
    assert not missing, "paths the docs cite that the repository does not hold:\n" + "\n".join(missing)


def test_every_file_named_alone_exists():
    names = {p.name for p in repository_files()}
    missing = []
    for doc, text in docs().items():
        for number, line in enumerate(text.splitlines(), 1):
            for m in BARE.finditer(URL.sub(" ", line)):
                if m.group(0) not in names and m.group(0) not in NOT_OURS:
                    missing.append(f"{doc}:{number}: {m.group(0)}")
    assert not missing, "file names the docs cite that no file of the repository has:\n" + "\n".join(missing)


def test_no_file_cites_a_file_outside_the_repository():
    outside = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            outside += [f"{where}: {m.group(0)}" for m in OUTSIDE.finditer(line)]
            for m in UP.finditer(line):
                target = (path.parent / m.group(0)).resolve()
                if not target.is_relative_to(ROOT):
                    outside.append(f"{where}: {m.group(0)}")
    assert not outside, "citations of files outside the repository:\n" + "\n".join(outside)


def test_every_result_is_cited():
    cited = {p for text in docs().values() for p in cited_paths(text)}
    results = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "results").iterdir())
    uncited = [r for r in results if r not in cited]
    assert not uncited, "files under docs/results/ that no doc cites:\n" + "\n".join(uncited)


def test_every_recorded_command_runs_a_script_of_the_repository():
    """A result whose JSON records its command was made by a script that is in bench/ or scripts/."""
    strays = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "command" not in record:
            continue
        scripts = re.findall(r"(?:bench|scripts)/[\w.-]+", record["command"])
        if not scripts or not all((ROOT / script).is_file() for script in scripts):
            strays.append(f"{path.name}: {record['command']}")
    assert not strays, "results made by a script the repository does not hold:\n" + "\n".join(strays)


@pytest.mark.parametrize("text, paths", [
    ("see `docs/results/a.{log,json}`.", ["docs/results/a.log", "docs/results/a.json"]),
    ("(app/engine/hf/reader.py, tests/engine/)", ["app/engine/hf/reader.py", "tests/engine/"]),
    ("`docs/results/cpu_*.json` and https://github.com/x/app/y", []),
    ("--json /tmp/bench_cpu.json, ~/.cache/djev-bench/, .venv/bin/python", []),
])
def test_cited_paths(text, paths):
    assert cited_paths(text) == paths
