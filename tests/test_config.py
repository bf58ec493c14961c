"""Settings: env names and defaults in one place, .env.example true to them, flags override env."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from app import build
from app.cli import build_parser, settings_from_args
from app.config import Settings, render_env_example

ROOT = Path(__file__).resolve().parent.parent


def test_env_example_matches_the_settings():
    assert (ROOT / ".env.example").read_text() == render_env_example(), \
        "regenerate: python -c 'from app.config import render_env_example; print(render_env_example(), end=\"\")' > .env.example"


def test_env_values_are_read_and_converted():
    settings = Settings.from_env({"STRUCTURED_PORT": "9000", "TEST_PAGE": "0", "API_KEY": "k", "CANVAS": "64"})
    server = settings.server
    assert (server.port, server.pages, server.api_key, settings.decisions.canvas) == (9000, False, "k", 64)
    assert build.limits(settings).max_samples == 32 and build.read_settings(settings).canvas_length == 64
    settings = Settings.from_env({"DEBIAS": "rotate+prior", "DEBIAS_ROTATIONS": "4"})
    assert build.limits(settings).debias == "rotate+prior" and build.read_settings(settings).debias_rotations == 4


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("STRUCTURED_PORT", "9000")
    monkeypatch.setenv("CONFIDENCE", "jev")
    args = build_parser().parse_args(["serve", "--port", "9100", "--no-pages", "--isolate"])
    settings = settings_from_args(args)
    assert settings.server.port == 9100 and settings.server.pages is False and settings.decisions.isolate is True
    assert settings.decisions.confidence == "jev"


@pytest.mark.parametrize("env, message", [
    ({"STRUCTURED_PORT": "eighty"}, "STRUCTURED_PORT must be an integer"),
    ({"ISOLATE": "maybe"}, "ISOLATE must be 1 or 0"),
    ({"ENGINE": "magic"}, "ENGINE must be one of hf"),
    ({"SWITCH_INTERVAL_MS": "0"}, "SWITCH_INTERVAL_MS must be from 0.01 to 100, not 0.0"),
    ({"CONFIDENCE": "x"}, "CONFIDENCE must be djev or jev"),
    ({"THOUGHT_PLACEMENT": "x"}, "THOUGHT_PLACEMENT"),
    ({"CANVAS": "8"}, "CANVAS must be 16 to 4096"),
    ({"MAX_INFLIGHT": "0"}, "MAX_INFLIGHT must be at least 1"),
    ({"MAX_SESSIONS": "-1"}, "MAX_SESSIONS must be at least 0"),
    ({"BATCH_GATHER_ROWS": "-1"}, "BATCH_GATHER_ROWS must be at least 0, not -1"),
    ({"QUANTIZE": "int4"}, "QUANTIZE must be empty or fp8, not 'int4'"),
    ({"DEBIAS": "sorted"}, "DEBIAS must be one of off, canonical, rotate"),
    ({"DEBIAS": "prior+rotate"}, "DEBIAS must be one of"),
    ({"DEBIAS_ROTATIONS": "1"}, "DEBIAS_ROTATIONS must be 2 to 32, not 1"),
    ({"DEBIAS_ROTATIONS": "33"}, "DEBIAS_ROTATIONS must be 2 to 32, not 33"),
    ({"DEBIAS_ROTATIONS": "eight"}, "DEBIAS_ROTATIONS must be an integer"),
    ({"REPLICA_ID": "gpu 0"}, "REPLICA_ID must be 1 to 64 letters, digits"),
    ({"REPLICA_ID": "gpu0\r\nx-evil: 1"}, "REPLICA_ID must be 1 to 64"),
    ({"REPLICA_ID": "g" * 65}, "REPLICA_ID must be 1 to 64"),
])
def test_bad_settings_are_refused_by_name(env, message):
    with pytest.raises(ValueError) as info:
        Settings.from_env(env)
    assert message in str(info.value)


def test_serve_refuses_bad_settings_with_exit_2(monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("ENGINE", "magic")
    assert main(["serve"]) == 2
    assert "ENGINE must be one of" in capsys.readouterr().err


def sync_settings_docs():
    """scripts/sync_settings_docs.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("sync_settings_docs", ROOT / "scripts" / "sync_settings_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_documents_every_setting_with_its_default():
    from app.config import env_table

    page = (ROOT / "docs" / "configuration.md").read_text()
    for env, default, _ in env_table():
        shown = f"`{default}`" if default else "empty"
        assert f"| `{env}` | {shown} |" in page, f"docs/configuration.md is missing {env} = {shown}"
    assert page == sync_settings_docs().render_configuration(), \
        "regenerate: .venv/bin/python scripts/sync_settings_docs.py"


def test_the_readme_commands_exist():
    readme = (ROOT / "README.md").read_text()
    assert "scripts/serve.sh" in readme and "scripts/test.sh" in readme
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("exec scripts/test.sh")
