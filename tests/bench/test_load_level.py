"""The closed-loop clients' transport (bench/served_load.py `load_level`, `PostConnection`): keep-alive
POSTs whose latencies count only for 200s, other statuses counted by kind, bodies read whole in both
framings (Content-Length and chunked), and a server that closes the connection answered again on a
new one."""

from __future__ import annotations

import itertools
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.served_load import load_level
from tests.conftest import live_server


def echo_app() -> Starlette:
    counter = itertools.count()

    async def decide(request: Request) -> Response:
        body = json.loads(await request.body())
        n = next(counter)
        if n % 5 == 1:
            return JSONResponse({"error": "busy"}, status_code=503)
        if n % 5 == 2:
            async def chunks():
                yield b'{"tag": '
                yield json.dumps(body["tag"]).encode() + b"}"
            return StreamingResponse(chunks(), media_type="application/json")
        if n % 5 == 3:
            return JSONResponse({"tag": body["tag"]}, headers={"Connection": "close"})
        return JSONResponse({"tag": body["tag"], "pad": "x" * 5000})

    return Starlette(routes=[Route("/v1/systemone", decide, methods=["POST"])])


def test_closed_loops_count_200s_and_other_statuses_over_keep_alive_connections():
    with live_server(echo_app()) as url:
        level = load_level(url, clients=4, seconds=0.5, tag="t", body=lambda tag: {"tag": tag})
    answered = len(level["latencies"])
    refused = level["errors"].get("HTTP 503", 0)
    assert answered > 20 and refused > 5, level["errors"]
    assert set(level["errors"]) == {"HTTP 503"}  # no transport error: chunked bodies and closes handled
    assert 0.5 <= level["elapsed_s"] < 5
