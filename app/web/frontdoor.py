"""Pure ASGI middleware every HTTP request passes.

`FrontDoor`: a request id on every response (and bound to `request_id_var`, so every log line the
request writes carries it), the bearer check on every POST before its body is read or its route
resolved, and the last word on an exception no handler took (a 500 through the one error map, the
traceback in the log, no internals to the client).

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
