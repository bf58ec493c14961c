"""Rewrite .env.example and README.md's configuration table from Settings (the one source of every
default). Run after adding or changing a setting: `.venv/bin/python scripts/sync_settings_docs.py`.
tests/test_config.py checks that both stay equal to Settings."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.config import env_table, render_env_example  # noqa: E402

HEADER = "| variable | default | meaning |"


def readme_table() -> str:
    rows = [HEADER, "|---|---|---|"]
    for env, default, meaning in env_table():
        shown = f"`{default}`" if default else "empty"
        rows.append(f"| `{env}` | {shown} | {meaning} |")
    return "\n".join(rows)


def main() -> None:
    (ROOT / ".env.example").write_text(render_env_example())
    readme = (ROOT / "README.md").read_text()
    start = readme.index(HEADER)
    end = readme.find("\n\n", start)
    end = len(readme) if end < 0 else end
    (ROOT / "README.md").write_text(readme[:start] + readme_table() + readme[end:])
    print("wrote .env.example and README.md's configuration table")


if __name__ == "__main__":
    main()
