"""Shared fixtures: the tiny random-weight checkpoint (built once per session), its reader and
tokenizer, a scripted reader, and live uvicorn servers on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import build
from app.build import hf_options
from app.config import Settings
from app.engine.hf.loader import load_hf_reader
from app.engine.tiny import TINY_MODEL_NAME, write_tiny_model
from app.server import free_port, serve_in_background  # noqa: F401 - tests import free_port from here
from tests.fakes import ScriptedReader

# The defaults as the server has them (Settings is the one place they are defined).
LIMITS = build.limits(Settings())
# How far two reads of the same request may differ on the tiny model: the flat turn reads a repeated
# request in a turn of another shape (its prompt then comes from the KV store, and other work may share
# the turn), which moves float32 results by ~1e-6; so repeats are equal within 1e-5, not bitwise.
REPEAT_TOLERANCE = 1e-5


def close(a, b, tolerance: float = REPEAT_TOLERANCE) -> bool:
    """Whether two answers (JSON values) are the same but for numbers within `tolerance`."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(close(a[key], b[key], tolerance) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tolerance) for x, y in zip(a, b))
    return a == b

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_tiny_reader(tiny_dir: Path, **settings):
    """A fresh reader on the tiny checkpoint: a reader belongs to one event loop (one app)."""
    return load_hf_reader(tiny_dir, hf_options(Settings.of(device="cpu", **settings), TINY_MODEL_NAME, tiny=True))


@pytest.fixture
def tiny_reader(tiny_dir: Path):
    return make_tiny_reader(tiny_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path):
    return make_tiny_reader(tiny_dir).tokenizer


@pytest.fixture
def scripted(tokenizer) -> ScriptedReader:
    return ScriptedReader(tokenizer)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# One way to serve an app on 127.0.0.1 in a background thread, shared with bench/ and scripts/.
live_server = serve_in_background


@pytest.fixture
def settings() -> Settings:
    return Settings()


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """`djev serve`/`selftest` called in a test configure the root logger with pytest's captured
    stderr, which is closed after the test: put the root logger back as it was."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
