"""Supervised camera sessions: a loop that dies closes the socket with 1011, MAX_SESSIONS refuses one
more with 1013, errors come through the one error map (503 for an engine not running), and no
session or task is left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.sync.client import connect

import app.web.stream as stream_module
from app.config import UNSAID_MAX_SESSIONS, Settings
from app.engine.base import EngineUnavailable
from app.server import create_app
from app.web.errors import CLOSE_INTERNAL, CLOSE_TRY_LATER
from tests.conftest import live_server
from tests.fakes import ScriptedReader
from tests.web.test_stream import GREY, WALK, closed_with, configure, receive, ws_url


async def session_tasks(request):
    names = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("djev-ws_")]
    return JSONResponse({"session_tasks": names})


def serve(reader, **settings):
    app = create_app(Settings.of(**settings), reader, extra_routes=[Route("/debug/tasks", session_tasks)])
    return app, live_server(app)


def assert_nothing_left(url: str, app) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        tasks = httpx.get(url + "/debug/tasks").json()["session_tasks"]
        if health["sessions"] == 0 and not tasks and health["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert health["sessions"] == 0 and app.state.services.sessions == {}
    assert tasks == [] and health["in_flight"] == 0


def test_a_decide_loop_that_dies_closes_the_socket_with_1011(tokenizer, monkeypatch):
    async def dying_decide_loop(self):
        await self.wakeup.wait()
        raise RuntimeError("the decide loop broke")

    monkeypatch.setattr(stream_module.StreamSession, "decide_loop", dying_decide_loop)
    app, server = serve(ScriptedReader(tokenizer))
    with server as url:
        with connect(ws_url(url)) as ws:
            configure(ws)
            ws.send(GREY)
            reason = closed_with(ws, CLOSE_INTERNAL)
            assert reason.startswith("session failed: internal error")
            assert "broke" not in reason  # no internals
        assert_nothing_left(url, app)


def test_a_receive_loop_that_dies_closes_the_socket_with_1011(tokenizer, monkeypatch):
    async def failing_handle_text(self, text):
        raise KeyError("receive side")

    monkeypatch.setattr(stream_module.StreamSession, "handle_text", failing_handle_text)
    app, server = serve(ScriptedReader(tokenizer))
    with server as url:
        with connect(ws_url(url)) as ws:
            receive(ws, "ready")
            ws.send(json.dumps({"type": "ping"}))
            closed_with(ws, CLOSE_INTERNAL)
        assert_nothing_left(url, app)


def test_one_session_past_max_sessions_is_refused_with_1013(tokenizer):
    app, server = serve(ScriptedReader(tokenizer), max_sessions=3)
    with server as url:
        open_sessions = [connect(ws_url(url)) for _ in range(3)]
        try:
            for ws in open_sessions:
                receive(ws, "ready")
            assert httpx.get(url + "/health").json()["sessions"] == 3
            with connect(ws_url(url)) as extra:
                assert "at most 3" in closed_with(extra, CLOSE_TRY_LATER)
            assert httpx.get(url + "/health").json()["sessions"] == 3
            # the open ones still work
            open_sessions[0].send(json.dumps({"type": "config", "request": WALK}))
            receive(open_sessions[0], "configured")
            open_sessions[0].send(GREY)
            assert receive(open_sessions[0], "result")["frame"] == 1
        finally:
            for ws in open_sessions:
                ws.close()
        assert_nothing_left(url, app)
        with connect(ws_url(url)) as ws:  # room again
            configure(ws)


def test_max_sessions_0_takes_what_the_engine_holds(tokenizer):
    reader = ScriptedReader(tokenizer)
    reader.info = dataclasses.replace(reader.info, max_sessions=2)
    app, server = serve(reader)  # MAX_SESSIONS=0, the default
    with server as url:
        assert httpx.get(url + "/health").json()["max_sessions"] == 2
        open_sessions = [connect(ws_url(url)) for _ in range(2)]
        try:
            for ws in open_sessions:
                receive(ws, "ready")
            with connect(ws_url(url)) as extra:
                assert "at most 2" in closed_with(extra, CLOSE_TRY_LATER)
        finally:
            for ws in open_sessions:
                ws.close()
        assert_nothing_left(url, app)


@pytest.mark.parametrize(("setting", "engine", "limit"), [(0, 7, 7), (3, 7, 3), (0, 0, UNSAID_MAX_SESSIONS)])
def test_the_session_limit_is_the_setting_else_the_engines_else_the_default(tokenizer, setting, engine, limit):
    reader = ScriptedReader(tokenizer)
    reader.info = dataclasses.replace(reader.info, max_sessions=engine)
    app = create_app(Settings.of(max_sessions=setting), reader)
    assert app.state.services.max_sessions == limit


def test_an_engine_not_running_reaches_a_camera_as_503(tokenizer):
    class Stopped(ScriptedReader):
        async def read(self, specs):
            raise EngineUnavailable("stopped")

    app, server = serve(Stopped(tokenizer))
    with server as url:
        with connect(ws_url(url)) as ws:
            configure(ws)
            ws.send(GREY)
            error = receive(ws, "error")
            assert error["status"] == 503 and error["frame"] == 1
            assert error["error"]["type"] == "unavailable_error" and "engine unavailable" in error["error"]["message"]
            ws.send(json.dumps({"type": "ping", "t": 1}))  # the session goes on
            assert receive(ws, "pong")["t"] == 1
        assert_nothing_left(url, app)


@pytest.mark.parametrize("timeout", [0.3])
def test_a_frame_past_request_timeout_is_a_504_error_message(tokenizer, timeout):
    class Slow(ScriptedReader):
        async def read(self, specs):
            await asyncio.sleep(30)

    app, server = serve(Slow(tokenizer), request_timeout=timeout)
    with server as url:
        with connect(ws_url(url)) as ws:
            configure(ws)
            ws.send(GREY)
            error = receive(ws, "error")
            assert error["status"] == 504 and error["error"]["type"] == "timeout_error"
        assert_nothing_left(url, app)
