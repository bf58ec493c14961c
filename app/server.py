"""The ASGI app and the process that serves it.

`create_app(settings, reader)` builds the Starlette app around a reader (the reader is passed in,
so tests can give it the tiny model or a fake). The app's lifespan starts and stops the reader; a
`StartingReader` (what `djev serve` passes) is started in a background task instead, so the
listener is up while the model loads, and the routes are handed the real reader once it is ready.
`serve_app()` runs the HTTP listener and, with TLS_PORT, an HTTPS listener in the same process, and
stops them a few seconds after a start-up that failed. A listener bound beyond loopback with no
API_KEY is logged as a warning at start: anyone on the network could use it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Iterator

from starlette.applications import Starlette
from starlette.routing import Route

from app.config import Settings
from app.decisions.calibration import Calibration
from app.engine.base import Reader
from app.engine.starting import StartingReader
from app.web import health, openai, pages, raw, stream, systemone
from app.web.errors import exception_handlers
from app.web.frontdoor import REQUEST_ID_HEADER, FrontDoor, ReplicaHeader, SecurityHeaders  # noqa: F401 - re-exported
from app.web.metrics import RequestMetrics
from app.web.services import Services

log = logging.getLogger("djev")

# Seconds a failed start-up keeps the listener up, `/health` saying "failed" with the reason, before
# `serve_app` stops and `djev serve` exits non-zero.
FAILED_START_LINGER_S = 2.0


def create_app(settings: Settings, reader: Reader, extra_routes: list | None = None,
               calibration: Calibration | None = None) -> Starlette:
    services = Services.build(settings, reader, calibration)
    services.metrics.watch(services)

    async def load_behind_the_listener(starting: StartingReader) -> None:
        try:
            await starting.start()
        except Exception:  # noqa: BLE001 - logged with its reason by the reader; /health says failed
            return
        loaded = starting.loaded
        if loaded is not None:
            services.use(loaded)
            log_ready(loaded)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading: asyncio.Task[None] | None = None
        if isinstance(reader, StartingReader):
            loading = asyncio.create_task(load_behind_the_listener(reader), name="djev-start-up")
        else:
            await reader.start()
            log_ready(reader)
        try:
            yield
        finally:
            if loading is not None:
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)
            await reader.stop()

    routes: list[Any] = [
        *health.routes,
        Route("/metrics", services.metrics.endpoint, methods=["GET"]),
        *systemone.routes,
        *openai.routes,
        *raw.routes,
        *stream.routes,
        *(pages.routes if settings.server.pages else []),
        *(extra_routes or []),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers())
    app.state.services = services
    app.state.startup = reader if isinstance(reader, StartingReader) else None
    # Added last = outermost: the request id and the last-resort error reply wrap everything, and
    # the request metrics wrap those (a 401 or 500 from the front door is counted too).
    app.add_middleware(SecurityHeaders)
    app.add_middleware(FrontDoor, api_key=settings.server.api_key)
    app.add_middleware(RequestMetrics, metrics=services.metrics)
    if settings.server.replica_id:  # outermost: every answer names its replica, a 500's included
        app.add_middleware(ReplicaHeader, replica_id=settings.server.replica_id)
    return app


def log_ready(reader: Reader) -> None:
    info = reader.info
    log.info("ready: model %s on %s (%s)%s", info.model, info.engine, info.device,
             " - TINY RANDOM MODEL, answers are random" if info.tiny else "")


def is_loopback(host: str) -> bool:
    """Whether a listener bound to `host` is reachable from this machine only: an address in
    127.0.0.0/8, `::1` (or 127.x mapped into IPv6), or `localhost`. Every other name, `0.0.0.0`, `::`
    and a LAN address are reachable from the network."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # a host name other than localhost: it may resolve to anything
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def open_listeners(settings: Settings, tls: bool) -> list[str]:
    """The URLs of the listeners anyone on the network may use: bound beyond loopback while no
    API_KEY is set (the HTTP one, and with `tls` the HTTPS one)."""
    server = settings.server
    if server.api_key or is_loopback(server.host):
        return []
    host = f"[{server.host}]" if ":" in server.host else server.host
    urls = [f"http://{host}:{server.port}"]
    if tls:
        urls.append(f"https://{host}:{server.tls_port}")
    return urls


def warn_if_open(settings: Settings, tls: bool) -> None:
    """A warning for each listener open to the network with no key, saying how to close it."""
    for url in open_listeners(settings, tls):
        log.warning("%s is open to the network with no API key: anyone who can reach it can run decisions and "
                    "generations and open camera sessions on this engine. Set API_KEY (or --api-key) to require "
                    "a bearer token, or HOST=127.0.0.1 (--host 127.0.0.1) to listen on this machine only", url)


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


async def serve_app(app: Starlette, settings: Settings, ssl: tuple[str, str] | None = None) -> int:
    """Run the HTTP listener, and the HTTPS one when `ssl` (cert, key) is given, in one loop, until
    stopped: 0. When the app's StartingReader fails to load, both stop FAILED_START_LINGER_S later: 1."""
    import uvicorn

    # log_config=None: uvicorn logs through the root logger `djev serve` configured (one format).
    common: dict[str, Any] = dict(log_level=settings.logs.log_level.lower(), access_log=False, proxy_headers=False,
                                  log_config=None, ws_max_size=settings.limits.max_image_bytes + 65536,
                                  timeout_graceful_shutdown=5)
    http = uvicorn.Server(uvicorn.Config(app, host=settings.server.host, port=settings.server.port, lifespan="on", **common))
    servers = [http]
    if ssl is not None and settings.server.tls_port:
        certfile, keyfile = ssl
        https = uvicorn.Server(uvicorn.Config(
            app, host=settings.server.host, port=settings.server.tls_port, lifespan="off",
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

    warn_if_open(settings, tls=len(servers) > 1)
    startup: StartingReader | None = app.state.startup
    failed = False

    async def stop_if_the_start_fails() -> None:
        nonlocal failed
        if startup is None:
            return
        while startup.status.state == "starting" and not http.should_exit:
            await asyncio.sleep(0.1)
        if startup.status.state == "failed":
            failed = True
            await asyncio.sleep(FAILED_START_LINGER_S)
            http.should_exit = True

    watch = asyncio.create_task(stop_if_the_start_fails(), name="djev-start-up-watch")
    try:
        await asyncio.gather(run_http(), *(server.serve() for server in servers[1:]))
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    return 1 if failed else 0
