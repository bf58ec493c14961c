"""The web layer's shape: wiring without an import circle, one error map for every transport, the
last-resort 500, security headers on every response."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from starlette.exceptions import HTTPException
from starlette.testclient import TestClient

from app.config import Settings
from app.decisions.errors import RequestError
from app.engine.base import EngineError, EngineInputError, EngineUnavailable
from app.server import create_app
from app.web.errors import ClientGone, HTTPError, error_reply
from app.web.frontdoor import content_security_policy
from tests.fakes import ScriptedReader

WEB = Path(__file__).resolve().parents[2] / "app" / "web"
TICKET = {"state": "x", "samples": 1, "questions": {"urgent": {"type": "noul"}}}


def test_no_web_module_imports_the_server():
    for path in sorted(WEB.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "app.server", f"{path.name} imports app.server"
            elif isinstance(node, ast.Import):
                assert all(alias.name != "app.server" for alias in node.names), f"{path.name} imports app.server"


@pytest.mark.parametrize("exc, status, kind, header", [
    (HTTPError(418, "teapot", param="pot"), 418, "invalid_request_error", None),
    (RequestError("seed: must be an integer", ("seed",)), 422, "invalid_request_error", None),
    (RequestError("Too many choices", ("questions", "a"), status=400, jev_detail="Too many choices."), 400,
     "invalid_request_error", None),
    (EngineInputError("prompt too long", status=400, param="state", error_type="max_tokens_exceeded"), 400,
     "max_tokens_exceeded", None),
    (EngineUnavailable("stopped"), 503, "unavailable_error", "retry-after"),
    (EngineError("boom"), 502, "upstream_error", None),
    (TimeoutError(), 504, "timeout_error", None),
    (HTTPException(404), 404, "not_found_error", None),
    (ClientGone(), 499, "client_closed_request", None),
    (KeyError("secret internals"), 500, "server_error", None),
])
def test_the_error_map(exc, status, kind, header):
    reply = error_reply(exc)
    assert reply.status == status
    assert set(reply.envelope) == {"error", "detail"} and reply.envelope["error"]["type"] == kind
    if header:
        assert reply.headers[header] == "1"
    if status == 422:
        assert reply.envelope["detail"][0]["loc"] == ["body", "seed"]
    if status == 500:
        assert "secret internals" not in reply.message and "KeyError" not in reply.message
    assert reply.close_code == {503: 1013, 422: 1003}.get(status, 1011 if status >= 500 else 1008)


def test_refusals_as_400_for_the_chat_form():
    reply = error_reply(RequestError("seed: must be an integer", ("seed",)), refusal_status=400)
    assert reply.status == 400 and reply.envelope["error"]["param"] == "seed"
    assert reply.envelope["detail"]["error_type"] == "invalid_request_error"
    assert error_reply(EngineUnavailable("x"), refusal_status=400).status == 503


def test_an_unexpected_error_is_a_logged_500_without_internals(tokenizer, caplog):
    class Buggy(ScriptedReader):
        async def read(self, specs):
            raise ZeroDivisionError("the secret sauce")

    with TestClient(create_app(Settings(), Buggy(tokenizer))) as client, caplog.at_level(logging.ERROR):
        response = client.post("/v1/systemone", json=TICKET)
        assert response.status_code == 500
        body = response.json()
        assert body["error"]["type"] == "server_error" and "secret sauce" not in response.text
        assert response.headers["x-typesafe-request-id"].startswith("req_")
        assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
        chat = {"messages": [{"role": "system", "content": '{"questions": [{"id": "a", "type": "noul"}]}'},
                             {"role": "user", "content": '{"x": 1}'}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 500
        assert client.get("/health").json()["in_flight"] == 0


def test_engine_unavailable_is_503_with_retry_after_over_rest_and_chat(tokenizer):
    class Stopped(ScriptedReader):
        async def read(self, specs):
            raise EngineUnavailable("stopped")

    with TestClient(create_app(Settings(), Stopped(tokenizer))) as client:
        response = client.post("/v1/systemone", json=TICKET)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        chat = {"messages": [{"role": "system", "content": '{"questions": [{"id": "a", "type": "noul"}]}'},
                             {"role": "user", "content": '{"x": 1}'}]}
        response = client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"


def test_security_headers_on_pages_and_api(tokenizer):
    with TestClient(create_app(Settings(), ScriptedReader(tokenizer))) as client:
        for path in ("/", "/walk", "/cube", "/health", "/static/js/api.js", "/nowhere"):
            response = client.get(path)
            assert response.headers["x-content-type-options"] == "nosniff", path
            assert response.headers["referrer-policy"] == "no-referrer", path
            policy = response.headers["content-security-policy"]
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["default-src"] == "'self'" and directives["script-src"] == "'self'"
            assert directives["img-src"] == "'self' blob: data:" and directives["media-src"] == "'self' blob:"
            assert directives["connect-src"] == "'self' ws://testserver wss://testserver"
            assert directives["object-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
            assert directives["base-uri"] == "'none'" and directives["style-src"] == "'self'"


@pytest.mark.parametrize("host, sockets", [
    ("127.0.0.1:8011", " ws://127.0.0.1:8011 wss://127.0.0.1:8011"),
    ("[::1]:8443", " ws://[::1]:8443 wss://[::1]:8443"),
    ("evil.example; script-src *", ""),
    ("a b", ""),
    (None, ""),
])
def test_the_policy_names_only_a_well_formed_own_host(host, sockets):
    policy = content_security_policy(host)
    assert f"connect-src 'self'{sockets};" in policy
    assert "script-src 'self';" in policy and "*" not in policy
