"""Logging: LOG_FORMAT=json writes one JSON object per line, text one readable line; the request id
is on every line a request causes (worker threads included); and no API key or request body
reaches any log, even at DEBUG, through a live server on the tiny model."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.sync.client import connect

from app.config import Settings
from app.logs import REDACTED, WireFilter, configure_logging, request_id_var
from app.server import REQUEST_ID_HEADER, create_app
from app.web.services import services
from tests.conftest import live_server, make_tiny_reader

KEY = "sk-log-test-5d1c9a7e0b"
MARK = "Quixotic-Marmalade-4417"  # in request bodies only: must never reach a log line


@pytest.fixture
def root_logging():
    """Puts the root logger back as pytest had it (configure_logging replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def configured(fmt: str, level: str = "debug", api_key: str = "") -> io.StringIO:
    out = io.StringIO()
    configure_logging(Settings.of(log_format=fmt, log_level=level, api_key=api_key), stream=out)
    return out


# ---------------------------------------------------------------------------- formats


def test_json_is_one_object_per_line_with_the_request_id_and_extra_fields(root_logging):
    out = configured("json")
    log = logging.getLogger("djev.test")
    log.info("outside a request")
    token = request_id_var.set("req_abc123")
    try:
        log.warning("inside %s", "one", extra={"route": "systemone", "reads": 3, "color_message": "\x1b[36mone"})
        try:
            raise ValueError("broken\nacross lines")
        except ValueError:
            log.exception("it failed")
    finally:
        request_id_var.reset(token)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # a traceback stays inside its line
    outside, inside, failed = (json.loads(line) for line in lines)
    assert set(outside) == {"time", "level", "logger", "message"}
    assert outside["level"] == "info" and outside["logger"] == "djev.test" and outside["message"] == "outside a request"
    assert outside["time"].endswith("+00:00") and "T" in outside["time"]
    assert inside == {**inside, "level": "warning", "message": "inside one", "request_id": "req_abc123",
                      "route": "systemone", "reads": 3}
    assert "color_message" not in inside  # uvicorn's coloured copy of the message
    assert failed["request_id"] == "req_abc123" and failed["level"] == "error"
    assert "ValueError: broken\nacross lines" in failed["exception"]


def test_text_puts_the_request_id_at_the_end_of_the_first_line(root_logging):
    out = configured("text")
    log = logging.getLogger("djev.test")
    token = request_id_var.set("req_def456")
    try:
        try:
            raise KeyError("k")
        except KeyError:
            log.exception("lookup failed")
    finally:
        request_id_var.reset(token)
    log.info("after")
    first, *trace = out.getvalue().splitlines()
    assert first.endswith("ERROR djev.test: lookup failed [req_def456]")
    assert trace[0] == "Traceback (most recent call last):"
    assert trace[-1].endswith("INFO djev.test: after")  # no id outside a request


def test_configure_logging_replaces_earlier_setup_and_sets_the_level(root_logging):
    logging.basicConfig(force=True, format="%(message)s")
    handler = configure_logging(Settings.of(log_level="warning"), stream=io.StringIO())
    root = logging.getLogger()
    assert root.handlers == [handler]
    assert root.level == logging.WARNING
    configure_logging(Settings.of(log_level="debug", log_format="json"), stream=io.StringIO())
    assert len(root.handlers) == 1 and root.level == logging.DEBUG


def test_the_api_key_is_redacted_from_any_line_that_carries_it(root_logging):
    out = configured("text", api_key=KEY)
    logging.getLogger("somelib").debug("headers: %s", {"authorization": f"Bearer {KEY}"})
    text = out.getvalue()
    assert KEY not in text and f"Bearer {REDACTED}" in text


def test_the_websocket_librarys_debug_lines_are_dropped_and_its_warnings_kept():
    import websockets

    inside = os.path.join(os.path.dirname(websockets.__file__), "server.py")
    wire = WireFilter()

    def record(level: int, path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, path, 1, "< sec-websocket-protocol: bearer.x", None, None)

    assert not wire.filter(record(logging.DEBUG, inside))
    assert wire.filter(record(logging.WARNING, inside))
    assert wire.filter(record(logging.DEBUG, str(Path(__file__))))


def test_djev_serve_sets_up_logging_from_its_settings(root_logging, monkeypatch):
    from app import cli
    from app.logs import JsonFormatter

    served: list[Settings] = []
    monkeypatch.setattr(cli, "serve", lambda settings: served.append(settings) or 0)
    assert cli.main(["serve", "--log-format", "json", "--log-level", "warning"]) == 0
    root = logging.getLogger()
    assert served and served[0].logs.log_format == "json"
    assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.WARNING


# ---------------------------------------------------------------------------- a live server


async def log_here_and_in_a_worker(request: Request) -> JSONResponse:
    log = logging.getLogger("djev.test")
    log.info("on the event loop")
    await services(request).offload(log.info, "in a worker thread")
    return JSONResponse({})


def decision(text: str) -> dict:
    return {"model": "jev-latest", "samples": 1, "state": {"ticket": f"{text} says the site is down"},
            "questions": {"urgent": {"type": "noul", "instructions": f"Is {text} urgent?"}}}


def test_every_line_of_a_request_carries_its_id(tiny_dir, root_logging):
    out = configured("json", level="info")
    app = create_app(Settings(), make_tiny_reader(tiny_dir), extra_routes=[Route("/debug/log", log_here_and_in_a_worker)])
    with live_server(app, log_config=None, log_level="info") as url, httpx.Client(base_url=url, timeout=120) as client:
        logged = client.get("/debug/log")
        decided = client.post("/v1/systemone", json=decision("a customer"))
    assert decided.status_code == 200, decided.text
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    by_message = {line["message"]: line for line in lines}
    for message in ("on the event loop", "in a worker thread"):
        assert by_message[message]["request_id"] == logged.headers[REQUEST_ID_HEADER]
    decision_line = next(line for line in lines if line["message"].startswith("systemone: "))
    assert decision_line["request_id"] == decided.headers[REQUEST_ID_HEADER]
    assert logged.headers[REQUEST_ID_HEADER] != decided.headers[REQUEST_ID_HEADER]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_api_key_and_no_request_body_in_any_log_at_debug(tiny_dir, root_logging, fmt):
    out = configured(fmt, level="debug", api_key=KEY)
    wrong_key = f"sk-wrong-{MARK}"
    auth = {"authorization": f"Bearer {KEY}"}
    app = create_app(Settings.of(api_key=KEY, log_level="debug", log_format=fmt), make_tiny_reader(tiny_dir))
    with live_server(app, log_config=None, log_level="debug") as url, httpx.Client(base_url=url, timeout=120) as client:
        assert client.post("/v1/systemone", json=decision(MARK), headers=auth).status_code == 200
        wrong = {"authorization": f"Bearer {wrong_key}"}
        assert client.post("/v1/systemone", json=decision(MARK), headers=wrong).status_code in (401, 403)
        bad = decision(MARK)
        bad["questions"]["urgent"]["type"] = f"kind-{MARK}"
        assert client.post("/v1/systemone", json=bad, headers=auth).status_code == 422
        assert client.post("/v1/systemone", content=f"{{not json {MARK}", headers=auth).status_code in (400, 422)
        # A camera session: the key as a subprotocol, and as an auth message; the body in the config.
        from tests.web.test_stream import GREY, closed_with, configure, receive, ws_url

        with connect(ws_url(url), subprotocols=["djev", f"bearer.{KEY}"]) as ws:
            configure(ws, decision(MARK))
            ws.send(GREY)
            receive(ws, "result")
        with connect(ws_url(url)) as ws:
            ws.send(json.dumps({"type": "auth", "token": KEY}))
            configure(ws, decision(MARK))
            ws.send(json.dumps({"type": f"kind-{MARK}"}))  # closes the session (1003): logged, without it
            closed_with(ws, 1003)
    text = out.getvalue()
    assert text.strip(), "nothing was logged: the capture is broken"
    if fmt == "json":
        records = [json.loads(line) for line in text.splitlines()]  # one JSON object per line
        assert {"debug", "info"} <= {record["level"] for record in records}
        assert any(record["message"].startswith("systemone: ") and record.get("request_id") for record in records)
    else:
        assert " DEBUG " in text and "systemone: " in text
    assert KEY not in text
    assert MARK not in text
