"""`/health` and the routes while the model starts behind the listener (a StartingReader whose load
waits on an event), after it is ready, when the load fails, and when the engine runs degraded."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient
from websockets.sync.client import connect

from app.config import Settings
from app.engine.base import ReaderInfo
from app.engine.starting import StartingReader
from app.server import create_app
from app.web.errors import CLOSE_TRY_LATER
from tests.conftest import live_server
from tests.fakes import ScriptedReader
from tests.web.test_stream import closed_with, ws_url

TICKET = {"state": "x", "samples": 1, "questions": {"urgent": {"type": "noul"}}}
PROVISIONAL = ReaderInfo(model="dgemma", engine="fake", device="loading", tiny=False, canvas_length=128)


class GatedLoad:
    """A load that reports a phase, then waits for `release` (or fails when `error` is set)."""

    def __init__(self, reader: ScriptedReader, error: Exception | None = None) -> None:
        self.reader = reader
        self.error = error
        self.reported = threading.Event()
        self.release = threading.Event()

    def __call__(self, progress) -> ScriptedReader:
        progress("loading weights", 3, 7)
        self.reported.set()
        assert self.release.wait(30), "the test never released the load"
        if self.error is not None:
            raise self.error
        return self.reader


def wait_for(client, status: str, timeout: float = 10.0) -> dict:
    """/health polled through `client` (a TestClient, or an httpx.Client on a live server) until it says `status`."""
    deadline = time.monotonic() + timeout
    while True:
        body = client.get("/health").json()
        if body["status"] == status or time.monotonic() > deadline:
            assert body["status"] == status, body
            return body
        time.sleep(0.02)


def test_health_says_starting_with_the_phase_then_ok_once_ready(tokenizer, caplog):
    load = GatedLoad(ScriptedReader(tokenizer))
    with caplog.at_level(logging.INFO, logger="djev"), \
            TestClient(create_app(Settings(), StartingReader(PROVISIONAL, load))) as client:
        assert load.reported.wait(10)
        response = client.get("/health")
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "starting" and body["ready"] is False
        assert (body["phase"], body["done"], body["total"]) == ("loading weights", 3, 7)
        assert body["elapsed_s"] >= 0 and body["device"] == "loading" and body["model"] == "dgemma"
        load.release.set()
        body = wait_for(client, "ok")
        assert body["ready"] is True and body["device"] == "cpu" and "phase" not in body
        assert client.get("/health").status_code == 200
        assert client.post("/v1/systemone", json=TICKET).status_code == 200
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("starting: loading weights") == 1
    assert any(m.startswith("ready in ") and m.endswith(" s") for m in messages), messages


def test_a_request_while_starting_is_a_503_envelope_naming_the_phase(tokenizer):
    load = GatedLoad(ScriptedReader(tokenizer))
    with TestClient(create_app(Settings(), StartingReader(PROVISIONAL, load))) as client:
        assert load.reported.wait(10)
        response = client.post("/v1/systemone", json=TICKET)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "unavailable_error"
        assert error["message"] == "engine unavailable: the model is starting: loading weights"
        raw = client.post("/v1/raw/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert raw.status_code == 503 and "the model is starting" in raw.json()["error"]["message"]
        load.release.set()
        wait_for(client, "ok")
        assert client.post("/v1/systemone", json=TICKET).status_code == 200


def test_a_camera_session_while_starting_is_closed_with_1013(tokenizer):
    load = GatedLoad(ScriptedReader(tokenizer))
    with live_server(create_app(Settings(), StartingReader(PROVISIONAL, load))) as url:
        assert load.reported.wait(10)
        with connect(ws_url(url)) as ws:
            reason = closed_with(ws, CLOSE_TRY_LATER)
        assert "the model is starting: loading weights" in reason
        load.release.set()
        with httpx.Client(base_url=url) as client:
            wait_for(client, "ok")
        with connect(ws_url(url)) as ws:
            assert '"ready"' in str(ws.recv(timeout=10))


def test_a_failed_load_says_failed_with_the_reason(tokenizer, caplog):
    load = GatedLoad(ScriptedReader(tokenizer), error=OSError("no weights in /nowhere"))
    with caplog.at_level(logging.ERROR, logger="djev"), \
            TestClient(create_app(Settings(), StartingReader(PROVISIONAL, load))) as client:
        load.release.set()
        body = wait_for(client, "failed")
        assert body["reason"] == "OSError: no weights in /nowhere" and body["phase"] == "loading weights"
        assert client.get("/health").status_code == 503
        message = client.post("/v1/systemone", json=TICKET).json()["error"]["message"]
        assert message == "engine unavailable: the model failed to load: OSError: no weights in /nowhere"
    assert any("no weights in /nowhere" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("starting", [False, True])
def test_a_degraded_engine_is_healthy_and_says_why(tokenizer, starting):
    reader = ScriptedReader(tokenizer)
    reader.degraded = "CUDA graphs off: capture failed"
    served = StartingReader(PROVISIONAL, lambda progress: reader) if starting else reader
    with TestClient(create_app(Settings(), served)) as client:
        body = wait_for(client, "degraded")
        assert body["reason"] == "CUDA graphs off: capture failed" and body["ready"] is True
        assert client.get("/health").status_code == 200


def test_every_page_shows_the_starting_banner_until_the_model_is_ready(tokenizer):
    load = GatedLoad(ScriptedReader(tokenizer))
    with TestClient(create_app(Settings(), StartingReader(PROVISIONAL, load))) as client:
        assert load.reported.wait(10)
        for path in ("/", "/walk", "/cube"):
            html = client.get(path).text
            assert 'id="starting-banner" role="status" aria-live="polite">the model is starting: loading weights (3/7)' \
                in html, path
            assert '<script type="module" src="/static/js/startup.js">' in html
        assert "getHealth" in client.get("/static/js/startup.js").text
        load.release.set()
        wait_for(client, "ok")
        for path in ("/", "/walk", "/cube"):
            assert 'id="starting-banner" role="status" aria-live="polite" hidden></div>' in client.get(path).text
