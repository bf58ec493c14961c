"""The ASGI app and the process that serves it.

`create_app(settings, reader)` builds the Starlette app around a reader (the reader is passed in,
so tests can give it the tiny model or a fake). The app's lifespan starts and stops the reader.
`serve()` runs the HTTP listener and, with TLS_PORT, an HTTPS listener in the same process.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings
from app.decisions.errors import RequestError
from app.decisions.request import Decision
from app.decisions.run import Decider
from app.engine.base import EngineError, EngineInputError, EngineUnavailable, Reader
from app.web import openai, pages, stream, systemone
from app.web.admission import Admission
from app.web.auth import check_authorization
from app.web.errors import HTTPError, json_response
from app.web.images import check_images

log = logging.getLogger("djev")

REQUEST_ID_HEADER = "x-typesafe-request-id"


@dataclass
class Services:
    """Everything a route needs, built once per app."""

    settings: Settings
    reader: Reader
    decider: Decider
    admission: Admission
    started: float = field(default_factory=time.time)
    sessions: dict[str, Any] = field(default_factory=dict)  # open /v1/stream sessions by id

    def check_images(self, decision: Decision) -> None:
        check_images(decision.images, self.settings.max_image_pixels)


class FrontDoor:
    """Pure ASGI middleware: a request id on every HTTP response, and the bearer check on every
    POST before its body is read or its route resolved."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        if scope["method"] == "POST" and self.api_key:
            headers = dict((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"])
            try:
                check_authorization(self.api_key, headers.get("authorization"))
            except HTTPError as exc:
                await exc.response()(scope, receive, send_with_id)
                return
        await self.app(scope, receive, send_with_id)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return exc.response()


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return HTTPError.from_request_error(exc).response()


async def _engine_input_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EngineInputError)
    return HTTPError(exc.status, exc.message, param=exc.param, error_type=exc.error_type, loc=(exc.param or "",)).response()


async def _engine_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, EngineUnavailable):
        return HTTPError(503, f"engine unavailable: {exc}", headers={"retry-after": "1"}).response()
    return HTTPError(502, f"engine failed: {exc}").response()


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = "unknown route" if exc.status_code == 404 else str(exc.detail)
    return HTTPError(exc.status_code, message, headers=dict(exc.headers or {})).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return HTTPError(500, f"internal error: {type(exc).__name__}").response()


async def health(request: Request) -> Response:
    svc: Services = request.app.state.services
    info = svc.reader.info
    ready = bool(getattr(svc.reader, "ready", True))
    body = {
        "status": "ok" if ready else "unavailable",
        "ready": ready,
        "model": info.model,
        "engine": info.engine,
        "device": info.device,
        "tiny": info.tiny,
        "canvas": info.canvas_length,
        "in_flight": svc.admission.in_flight,
        "sessions": len(svc.sessions),
        "uptime_s": round(time.time() - svc.started, 1),
    }
    if info.tiny:
        body["warning"] = "tiny random-weight model: every answer is random"
    return json_response(body, status=200 if ready else 503)


def create_app(settings: Settings, reader: Reader, extra_routes: list | None = None) -> Starlette:
    services = Services(
        settings=settings,
        reader=reader,
        decider=Decider(reader, settings.read_settings),
        admission=Admission(settings.max_inflight),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await reader.start()
        info = reader.info
        log.info("ready: model %s on %s (%s)%s", info.model, info.engine, info.device,
                 " - TINY RANDOM MODEL, answers are random" if info.tiny else "")
        try:
            yield
        finally:
            await reader.stop()

    routes: list[Any] = [
        Route("/health", health, methods=["GET"]),
        *systemone.routes,
        *openai.routes,
        *stream.routes,
        *(pages.routes if settings.pages else []),
        *(extra_routes or []),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            HTTPError: _http_error,
            RequestError: _request_error,
            EngineInputError: _engine_input_error,
            EngineError: _engine_error,
            StarletteHTTPException: _starlette_error,
            Exception: _unexpected,
        },
    )
    app.state.services = services
    app.add_middleware(FrontDoor, api_key=settings.api_key)
    return app


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def serve_in_background(app: Starlette, port: int | None = None, **uvicorn_options: Any) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 in a background thread (its own event loop, lifespan on);
    yields the base URL. For tests, benchmarks and scripts that need a real listener in-process."""
    import threading

    import uvicorn

    port = port or free_port()
    options: dict[str, Any] = {"log_level": "warning", "access_log": False, "proxy_headers": False, **uvicorn_options}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", **options))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="djev-background-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the background server did not start")
        time.sleep(0.02)
    scheme = "https" if options.get("ssl_certfile") else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def serve_app(app: Starlette, settings: Settings, ssl: tuple[str, str] | None = None) -> None:
    """Run the HTTP listener, and the HTTPS one when `ssl` (cert, key) is given, in one loop."""
    import uvicorn

    # log_config=None: uvicorn logs through the root logger `djev serve` configured (one format).
    common = dict(log_level=settings.log_level.lower(), access_log=False, proxy_headers=False, log_config=None,
                  ws_max_size=settings.max_image_bytes + 65536, timeout_graceful_shutdown=5)
    http = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on", **common))
    servers = [http]
    if ssl is not None and settings.tls_port:
        certfile, keyfile = ssl
        https = uvicorn.Server(uvicorn.Config(
            app, host=settings.host, port=settings.tls_port, lifespan="off",
            ssl_certfile=certfile, ssl_keyfile=keyfile, **common,
        ))
        https.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        servers.append(https)

    async def run_http() -> None:
        # The HTTP server owns the signal handlers and the lifespan; when it stops, so does HTTPS.
        try:
            await http.serve()
        finally:
            for other in servers[1:]:
                other.should_exit = True

    await asyncio.gather(run_http(), *(server.serve() for server in servers[1:]))
