"""REPLICA_ID: a replica behind a load balancer names itself on every answer (the x-djev-replica
header on HTTP responses, errors included, and on the websocket's 101; `replica` in a camera
session's `ready`, which a browser can read); a lone server with no REPLICA_ID sends no header."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from websockets.sync.client import connect

from app.config import Settings
from app.server import create_app
from app.web.frontdoor import REPLICA_HEADER
from tests.conftest import live_server
from tests.fakes import ScriptedReader

TICKET = {"state": "x", "samples": 1, "questions": {"urgent": {"type": "noul"}}}


def test_every_http_answer_names_the_replica_errors_and_refusals_included(tokenizer):
    app = create_app(Settings.of(replica_id="gpu1", api_key="k"), ScriptedReader(tokenizer))
    with TestClient(app) as client:
        answers = {
            "ok": client.post("/v1/systemone", json=TICKET, headers={"authorization": "Bearer k"}),
            "health": client.get("/health"),
            "page": client.get("/walk"),
            "not found": client.get("/nowhere"),
            "invalid": client.post("/v1/systemone", json={"state": "x"}, headers={"authorization": "Bearer k"}),
            "no key": client.post("/v1/systemone", json=TICKET),  # refused by the front door, before any route
        }
    assert {name: r.status_code for name, r in answers.items()} == {
        "ok": 200, "health": 200, "page": 200, "not found": 404, "invalid": 422, "no key": 403}
    assert {name: r.headers.get(REPLICA_HEADER) for name, r in answers.items()} == dict.fromkeys(answers, "gpu1")
    assert answers["ok"].headers.get_list(REPLICA_HEADER) == ["gpu1"]  # once


def test_a_lone_server_sends_no_replica_header(tokenizer):
    with TestClient(create_app(Settings(), ScriptedReader(tokenizer))) as client:
        assert REPLICA_HEADER not in client.get("/health").headers


@pytest.mark.parametrize("replica_id", ["gpu0", ""])
def test_the_websocket_handshake_and_ready_name_the_replica(tokenizer, replica_id):
    app = create_app(Settings.of(replica_id=replica_id), ScriptedReader(tokenizer))
    with live_server(app) as url, connect(url.replace("http", "ws", 1) + "/v1/stream") as ws:
        ready = json.loads(ws.recv(timeout=10))
        assert ws.response is not None
        handshake = ws.response.headers.get(REPLICA_HEADER)
    assert ready["type"] == "ready"
    assert (handshake, ready["replica"]) == ((replica_id, replica_id) if replica_id else (None, None))
