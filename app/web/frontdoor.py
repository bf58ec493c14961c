"""Pure ASGI middleware every HTTP request passes.

`FrontDoor`: a request id on every response (and bound to `request_id_var`, so every log line the
request writes carries it), the bearer check on every POST before its body is read or its route
resolved, and the last word on an exception no handler took (a 500 through the one error map, the
traceback in the log, no internals to the client).

`ReplicaHeader`: with REPLICA_ID set, `x-djev-replica: <id>` on every HTTP response and on the
websocket handshake's 101, so a client behind a load balancer (docs/deploy.md, "Replicas behind
HAProxy") sees which replica answered; a browser's WebSocket cannot read handshake headers, so a
camera session's `ready` message says it too.

`SecurityHeaders`: a Content-Security-Policy allowing the server itself plus what the pages really
use (`blob:` and `data:` images for previews and the favicon, `blob:` media for the camera, the
page's own `ws:`/`wss:` endpoint), `nosniff` and `Referrer-Policy` on every response.
"""

from __future__ import annotations

import re
import secrets

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.logs import request_id_var
from app.web.auth import check_authorization
from app.web.errors import HTTPError, error_reply

REQUEST_ID_HEADER = "x-typesafe-request-id"
REPLICA_HEADER = "x-djev-replica"


class FrontDoor:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            request_id_var.set(None)
            await self.app(scope, receive, send)
            return
        request_id = "req_" + secrets.token_hex(12)
        # Not reset on the way out: the outermost error handler logs an unexpected exception after
        # the middleware returns, in the same task, and that line needs the id most. Each request
        # runs in a task of its own, so the value ends with it.
        request_id_var.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        if scope["method"] == "POST" and self.api_key:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            try:
                check_authorization(self.api_key, headers.get("authorization"))
            except HTTPError as exc:
                await exc.response()(scope, receive, send_with_id)
                return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:  # the status is on the wire already; the server closes the connection
                raise
            await error_reply(exc).response()(scope, receive, send_with_id)


# A host as a browser sends it: a name or IPv4 address, or a bracketed IPv6 address, and a port.
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$")


def content_security_policy(host: str | None) -> str:
    """The pages' policy; `host` (the request's own Host header) adds its websocket endpoint, which
    not every browser counts as 'self'."""
    sockets = f" ws://{host} wss://{host}" if host and _HOST.match(host) else ""
    return "; ".join((
        "default-src 'self'",
        "img-src 'self' blob: data:",
        "media-src 'self' blob:",
        f"connect-src 'self'{sockets}",
        "worker-src 'self'",
        "manifest-src 'self'",
        "style-src 'self'",
        "script-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ))


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        policy = content_security_policy(host)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["content-security-policy"] = policy
                headers["x-content-type-options"] = "nosniff"
                headers["referrer-policy"] = "no-referrer"
            await send(message)

        await self.app(scope, receive, send_with_headers)


class ReplicaHeader:
    """Names this replica on every response: HTTP responses (errors and the front door's own
    included, as it sits outside them) and the websocket's accept, which ASGI lets carry headers."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.replica_id = replica_id
        self.header = (REPLICA_HEADER.encode("latin-1"), replica_id.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.replica_id)
            elif message["type"] == "websocket.accept":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_replica)
