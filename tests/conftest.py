"""Shared fixtures: the tiny random-weight checkpoint (built once per session), its reader and
tokenizer, a scripted reader, and live uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from app.config import Settings
from app.cli import hf_options
from app.engine.hf import load_hf_reader
from app.engine.tiny import TINY_MODEL_NAME, write_tiny_model
from tests.fakes import ScriptedReader

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_tiny_reader(tiny_dir: Path, **settings):
    """A fresh reader on the tiny checkpoint: a reader belongs to one event loop (one app)."""
    return load_hf_reader(tiny_dir, hf_options(Settings(device="cpu", **settings), TINY_MODEL_NAME, tiny=True))


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app, port: int | None = None, **uvicorn_options) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 in a background thread; yields the base URL."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **uvicorn_options)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    scheme = "https" if uvicorn_options.get("ssl_certfile") else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture
def settings() -> Settings:
    return Settings()
