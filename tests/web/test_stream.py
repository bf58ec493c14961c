"""/v1/stream camera sessions over a real uvicorn server: frames decided, latest frame wins,
ask_if chaining per frame, config changes, bad input closes with documented codes, auth, cleanup."""

from __future__ import annotations

import base64
import io
import json
import socket
import time

import pytest
from PIL import Image
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.config import Settings
from app.server import create_app
from app.web.stream import CLOSE_AUTH, CLOSE_FLOOD, CLOSE_TOO_BIG, CLOSE_UNSUPPORTED
from tests.conftest import live_server, make_tiny_reader
from tests.fakes import ScriptedReader

DANGER = ["danger: stairs", "danger: wall ahead", "danger: object ahead", "danger: pet ahead"]
WALK = {
    "model": "jev-latest",
    "state": {"note": "one frame from a phone's back camera, pointed the way the person is walking"},
    "samples": 1,
    "questions": {
        "ahead": {"type": "choice", "instructions": "What is straight ahead within 2 meters?", "criteria": {
            "all clear ahead": None, "danger: stairs": None, "danger: wall ahead": None,
            "danger: object ahead": None, "danger: pet ahead": None, "door ahead": None}},
        "side": {"type": "choice", "instructions": "Which half of the frame is the obstacle in?",
                 "criteria": {"left half": None, "right half": None}, "ask_if": {"ahead": DANGER}},
    },
}


def jpeg(color=(90, 90, 90), size=(96, 72)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "JPEG")
    return out.getvalue()


RED, GREY = jpeg((220, 10, 10)), jpeg((90, 90, 90))


def ws_url(base: str) -> str:
    return base.replace("http", "ws", 1) + "/v1/stream"


def receive(ws, kind: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if message["type"] == kind:
            return message


def configure(ws, request=WALK) -> dict:
    receive(ws, "ready")
    ws.send(json.dumps({"type": "config", "request": request}))
    return receive(ws, "configured")


def closed_with(ws, code: int) -> str:
    with pytest.raises(ConnectionClosed) as info:
        for _ in range(50):
            ws.recv(timeout=10)
    assert info.value.rcvd is not None, "the server closed without a close frame"
    assert info.value.rcvd.code == code, info.value.rcvd
    return info.value.rcvd.reason


async def task_route(request):
    import asyncio

    names = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("djev-ws_")]
    return JSONResponse({"session_tasks": names})


@pytest.fixture
def tiny_server(tiny_dir):
    app = create_app(Settings(), make_tiny_reader(tiny_dir), extra_routes=[Route("/debug/tasks", task_route)])
    with live_server(app) as url:
        yield url, app


@pytest.fixture
def scripted_server(tokenizer):
    # The scripted reader sees a red frame as a wall ahead and anything else as all clear.
    def pick(spec, slot):
        if len(spec.label_ids[slot]) == 6:
            return 2 if spec.prompt.images and spec.prompt.images[0].data == RED else 0
        return 1  # right half

    reader = ScriptedReader(tokenizer, conf=0.9, pick=pick)
    with live_server(create_app(Settings(), reader)) as url:
        yield url, reader


def test_a_session_decides_frames_with_timing(tiny_server):
    url, _ = tiny_server
    with connect(ws_url(url)) as ws:
        ready = receive(ws, "ready")
        assert ready["model"] == "djev-tiny-random" and ready["tiny"] is True
        ws.send(json.dumps({"type": "config", "request": WALK}))
        assert receive(ws, "configured")["questions"] == ["ahead", "side"]
        for number in (1, 2, 3):
            ws.send(GREY if number % 2 else RED)
            result = receive(ws, "result")
            assert result["frame"] == number and result["dropped"] == []
            assert result["answers"]["ahead"]["type"] == "choice"
            assert set(result["timing"]) == {"queue_ms", "read_ms", "total_ms"}
            assert result["timing"]["total_ms"] >= result["timing"]["read_ms"] > 0
            assert result["usage"]["input_tokens"] > 0 and result["model"] == "djev-tiny-random"


def test_frames_faster_than_decisions_are_dropped_latest_wins(tiny_server):
    url, _ = tiny_server
    with connect(ws_url(url)) as ws:
        configure(ws)
        for _ in range(8):
            ws.send(GREY)
        decided, dropped = [], []
        while 8 not in decided:
            result = receive(ws, "result")
            decided.append(result["frame"])
            dropped.extend(result["dropped"])
        assert decided[-1] == 8 and decided == sorted(decided)
        assert dropped and sorted(decided + dropped) == list(range(1, 9))
        assert result["dropped_total"] == len(dropped)
        assert not set(decided) & set(dropped)


def test_a_danger_frame_asks_the_side_question_and_a_clear_one_skips_it(scripted_server):
    url, reader = scripted_server
    with connect(ws_url(url)) as ws:
        configure(ws)
        ws.send(RED)
        blocked = receive(ws, "result")
        assert blocked["answers"]["ahead"]["choice"] == "danger: wall ahead"
        assert blocked["answers"]["side"]["choice"] == "right half"
        assert blocked["diagnostics"]["stages"] == [["ahead"], ["side"]]
        assert blocked["diagnostics"]["conditioning"] == "restated"
        ws.send(GREY)
        clear = receive(ws, "result")
        assert clear["answers"]["ahead"]["choice"] == "all clear ahead"
        assert clear["answers"]["side"] is None
        assert clear["diagnostics"]["skipped"]["side"]["was"] == "all clear ahead"
    # The blocked frame took two image reads (the second restating the hazard), the clear one one.
    assert len(reader.reads) == 3
    restated = reader.tokenizer.decode(reader.reads[1].prompt.ids)
    assert "Answers so far:" in restated and "q1: danger: wall ahead" in restated


def test_the_config_can_change_mid_session_and_frames_may_be_data_urls(scripted_server):
    url, _ = scripted_server
    with connect(ws_url(url)) as ws:
        configure(ws)
        ws.send(GREY)
        assert set(receive(ws, "result")["answers"]) == {"ahead", "side"}
        other = {"state": "a frame", "samples": 1, "questions": {"lit": {"type": "noul", "instructions": "Is it lit?"}}}
        ws.send(json.dumps({"type": "config", "request": other}))
        assert receive(ws, "configured")["questions"] == ["lit"]
        data_url = "data:image/jpeg;base64," + base64.b64encode(RED).decode()
        ws.send(json.dumps({"type": "frame", "image": data_url}))
        result = receive(ws, "result")
        assert list(result["answers"]) == ["lit"] and result["frame"] == 2
        ws.send(json.dumps({"type": "ping", "t": 5}))
        assert receive(ws, "pong")["t"] == 5


def test_a_session_plans_once_per_config(tokenizer, monkeypatch):
    """A frame's plan is its config's (a plan reads how many images, never their bytes): made at a
    config's first frame and reused, made anew after a config change."""
    import app.web.stream as stream_module

    plans = []
    real = stream_module.priced_plan

    def counted(svc, decision):
        plans.append([q.qid for q in decision.questions])
        return real(svc, decision)

    monkeypatch.setattr(stream_module, "priced_plan", counted)
    with live_server(create_app(Settings(), ScriptedReader(tokenizer, conf=0.9))) as url, connect(ws_url(url)) as ws:
        configure(ws)
        for frame in (GREY, RED, GREY):
            ws.send(frame)
            assert set(receive(ws, "result")["answers"]) == {"ahead", "side"}
        other = {"state": "a frame", "samples": 1, "questions": {"lit": {"type": "noul", "instructions": "Is it lit?"}}}
        ws.send(json.dumps({"type": "config", "request": other}))
        receive(ws, "configured")
        for frame in (GREY, RED):
            ws.send(frame)
            assert list(receive(ws, "result")["answers"]) == ["lit"]
    assert plans == [["ahead", "side"], ["lit"]]


def test_config_errors_are_reported_without_closing(scripted_server):
    url, _ = scripted_server
    with connect(ws_url(url)) as ws:
        receive(ws, "ready")
        ws.send(GREY)
        early = receive(ws, "error")
        assert early["status"] == 409 and "config" in early["error"]["message"]
        ws.send(json.dumps({"type": "config", "request": {"state": "x", "questions": {}}}))
        error = receive(ws, "error")
        assert error["status"] == 422 and "non-empty map" in error["error"]["message"]
        ws.send(json.dumps({"type": "config", "request": {**WALK, "images": ["data:image/png;base64,AA=="]}}))
        assert "frames" in receive(ws, "error")["error"]["message"]
        configure_again = json.dumps({"type": "config", "request": WALK})
        ws.send(configure_again)
        receive(ws, "configured")
        ws.send(GREY)
        assert receive(ws, "result")["frame"] == 2


@pytest.mark.parametrize("send, code", [
    (b"this is not an image", CLOSE_UNSUPPORTED),
    ("this is not json", CLOSE_UNSUPPORTED),
    (json.dumps({"type": "launch"}), CLOSE_UNSUPPORTED),
    (json.dumps({"type": "frame", "image": "http://example.invalid/x.jpg"}), CLOSE_UNSUPPORTED),
    (json.dumps({"type": "frame", "image": "data:image/jpeg;base64,@@@"}), CLOSE_UNSUPPORTED),
])
def test_garbage_closes_the_session(scripted_server, send, code):
    url, _ = scripted_server
    with connect(ws_url(url)) as ws:
        configure(ws)
        ws.send(send)
        closed_with(ws, code)


def test_oversized_frames_close_with_1009(tokenizer):
    app = create_app(Settings.of(max_image_bytes=2000), ScriptedReader(tokenizer))
    with live_server(app) as url, connect(ws_url(url), max_size=None) as ws:
        configure(ws)
        ws.send(jpeg(size=(640, 480)) + b"\0" * 4000)
        assert "limit" in closed_with(ws, CLOSE_TOO_BIG)


def test_a_flood_of_messages_closes_with_4029(scripted_server):
    url, _ = scripted_server
    with connect(ws_url(url)) as ws:
        configure(ws)
        with pytest.raises(ConnectionClosed) as info:
            for _ in range(2000):
                ws.send(json.dumps({"type": "ping"}))
            for _ in range(3000):
                ws.recv(timeout=10)
        assert info.value.rcvd is not None and info.value.rcvd.code == CLOSE_FLOOD


class TestAuth:
    @pytest.fixture
    def keyed(self, tokenizer):
        with live_server(create_app(Settings.of(api_key="camera-key"), ScriptedReader(tokenizer))) as url:
            yield url

    def test_first_message_auth(self, keyed):
        with connect(ws_url(keyed)) as ws:
            ws.send(json.dumps({"type": "auth", "token": "camera-key"}))
            configure(ws)
            ws.send(GREY)
            assert receive(ws, "result")["frame"] == 1

    def test_bearer_subprotocol(self, keyed):
        with connect(ws_url(keyed), subprotocols=["djev", "bearer.camera-key"]) as ws:
            assert ws.subprotocol == "djev"
            configure(ws)

    def test_no_auth_or_a_wrong_token_closes_with_1008(self, keyed):
        with connect(ws_url(keyed)) as ws:
            ws.send(json.dumps({"type": "config", "request": WALK}))
            assert "authentication required" in closed_with(ws, CLOSE_AUTH)
        with connect(ws_url(keyed)) as ws:
            ws.send(json.dumps({"type": "auth", "token": "nope"}))
            assert "wrong token" in closed_with(ws, CLOSE_AUTH)


def test_sessions_killed_abruptly_leave_nothing_behind(tiny_server):
    import httpx

    url, app = tiny_server
    for index in range(20):
        ws = connect(ws_url(url))
        receive(ws, "ready")
        ws.send(json.dumps({"type": "config", "request": WALK}))
        if index % 2:
            receive(ws, "configured")
            ws.send(GREY)  # kill it mid-decision
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        tasks = httpx.get(url + "/debug/tasks").json()["session_tasks"]
        if health["sessions"] == 0 and not tasks and health["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert health["sessions"] == 0 and app.state.services.sessions == {}
    assert tasks == [] and health["in_flight"] == 0
    # and the server still serves
    with connect(ws_url(url)) as ws:
        configure(ws)
        ws.send(GREY)
        assert receive(ws, "result")["frame"] == 1
