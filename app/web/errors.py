"""One error envelope for every route, and one map from any exception to it.

The envelope is readable by the reference's clients and by Jev's:

    {"error": {"message", "type", "param"}, "detail": ...}

`detail` is FastAPI's list `[{"loc": ["body", ...], "msg", "type"}]` for a 422 and
`{"error_type", "message"}` otherwise; where Jev answers a limit with a plain-string detail
("Too many choices. ..."), that string is the detail.

`error_reply(exc)` is the only place an exception becomes a status: the REST exception handlers,
the OpenAI-shaped routes and the camera websocket all call it, so one failure reads the same on
every transport (an engine that is not running is a 503 with Retry-After everywhere).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from app.decisions.errors import RequestError
from app.engine.base import EngineError, EngineInputError, EngineUnavailable

log = logging.getLogger("djev.errors")

DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    499: "client_closed_request",
    504: "timeout_error",
    529: "overloaded_error",
}
RETRY_AFTER_SECONDS = 1
RETRY_HEADERS = {"retry-after": str(RETRY_AFTER_SECONDS), "retry-after-ms": str(RETRY_AFTER_SECONDS * 1000)}

# Websocket close codes, the only place they are defined (RFC 6455 §7.4.1 and the IANA registry; a
# camera session's are documented in docs/wire.md §10).
CLOSE_AUTH = 1008  # policy violation: no or wrong key, and any refusal given no other code
CLOSE_UNSUPPORTED = 1003  # unsupported data: not JSON, not an image, an unknown message type
CLOSE_TOO_BIG = 1009  # a frame or message over the size limit
CLOSE_INTERNAL = 1011  # the server failed (a loop of a session, any 5xx)
CLOSE_TRY_LATER = 1013  # try again later: MAX_SESSIONS sessions are open, or the engine is not running
CLOSE_FLOOD = 4029  # a private code: more messages than the rate limit allows
# The close code by status, for errors that end a camera session.
_CLOSE_CODES = {401: CLOSE_AUTH, 403: CLOSE_AUTH, 413: CLOSE_TOO_BIG, 415: CLOSE_UNSUPPORTED, 422: CLOSE_UNSUPPORTED,
                503: CLOSE_TRY_LATER, 529: CLOSE_TRY_LATER}


class HTTPError(Exception):
    """An error response raised from anywhere in the web layer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        loc: tuple = (),
        kind: str = "value_error",
        detail: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or DEFAULT_TYPES.get(status, "invalid_request_error")
        self.loc = loc
        self.kind = kind
        self.detail = detail
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, exc: RequestError) -> "HTTPError":
        return cls(exc.status, exc.message, param=exc.param, loc=exc.loc, kind=exc.kind, detail=exc.jev_detail)

    def body(self) -> dict:
        detail = self.detail
        if detail is None:
            if self.status == 422:
                detail = [{"loc": ["body", *self.loc], "msg": self.message, "type": self.kind}]
            else:
                detail = {"error_type": self.error_type, "message": self.message}
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param}, "detail": detail}

    def response(self) -> JSONResponse:
        return error_reply(self).response()


def json_invalid(error: str, position: int, where: str = "body", explained: str | None = None) -> HTTPError:
    """A body (or the multipart `request` part) that is not JSON, in FastAPI's shape
    (`type: json_invalid`, `loc: ["body", position]`, the parser's error in `ctx.error`), with our
    envelope's `error` member beside it. `position` is the character offset where parsing failed
    (0 where the parser cannot say: a NaN, a duplicate key)."""
    loc = ["body", position] if where == "body" else ["body", where, position]
    detail = [{"loc": loc, "msg": "JSON decode error", "ctx": {"error": error}, "type": "json_invalid"}]
    return HTTPError(422, f"{where}: not valid JSON ({explained or error})", param=where, kind="json_invalid",
                     detail=detail)


def body_missing(where: str = "body") -> HTTPError:
    """An empty body, as FastAPI answers a missing required body."""
    loc = ["body"] if where == "body" else ["body", where]
    detail = [{"loc": loc, "msg": "Field required", "type": "missing"}]
    return HTTPError(422, f"{where}: empty; send a JSON object with state and questions", param=where,
                     kind="missing", detail=detail)


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its work was cancelled. Nobody reads
    the reply; 499 (nginx's "client closed request") is what logs and metrics see."""


@dataclass(frozen=True)
class ErrorReply:
    """What a client is told about a failure: the status, the envelope and the headers."""

    status: int
    envelope: dict
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def close_code(self) -> int:
        """The websocket close code for this error when it ends a camera session."""
        return _CLOSE_CODES.get(self.status, CLOSE_INTERNAL if self.status >= 500 else CLOSE_AUTH)

    @property
    def message(self) -> str:
        return self.envelope["error"]["message"]

    def response(self) -> JSONResponse:
        return json_response(self.envelope, status=self.status, headers=self.headers)


def error_reply(exc: BaseException, *, refusal_status: int = 422) -> ErrorReply:
    """Any exception as the client sees it. `refusal_status` is the status of a validation refusal
    (422 on Jev's routes; the reference's chat form answers every refusal with 400)."""
    error = _as_http_error(exc)
    if error.status == 422 and refusal_status != 422:
        error = HTTPError(refusal_status, error.message, param=error.param, headers=error.headers)
    return ErrorReply(error.status, error.body(), dict(error.headers))


def _as_http_error(exc: BaseException) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestError):
        return HTTPError.from_request_error(exc)
    if isinstance(exc, EngineInputError):
        return HTTPError(exc.status, exc.message, param=exc.param, error_type=exc.error_type, loc=(exc.param or "",))
    if isinstance(exc, EngineUnavailable):
        return HTTPError(503, f"engine unavailable: {exc}", headers=dict(RETRY_HEADERS))
    if isinstance(exc, EngineError):
        return HTTPError(502, f"engine failed: {exc}")
    if isinstance(exc, ClientGone):
        return HTTPError(499, "the client closed the connection before the answer was ready")
    if isinstance(exc, TimeoutError):
        return HTTPError(504, "the request took longer than this server's REQUEST_TIMEOUT; its work was dropped")
    if isinstance(exc, StarletteHTTPException):
        message = "unknown route" if exc.status_code == 404 else str(exc.detail)
        return HTTPError(exc.status_code, message, headers=dict(exc.headers or {}))
    # A bug: the traceback goes to the log, the client gets no internals.
    log.error("unexpected error", exc_info=(type(exc), exc, exc.__traceback__))
    return HTTPError(500, "internal error: the server failed on this request (logged with its request id)")


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    """JSON with non-ASCII kept (option names and ids come back byte for byte) and no NaN."""
    return _Json(payload, status_code=status, headers=headers)


def render_json(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return render_json(content)


# The REST exception handlers: every class the map knows, one handler. Anything else reaches the
# front door (app/web/frontdoor.py), which answers with the same map.
HANDLED = (HTTPError, ClientGone, RequestError, EngineInputError, EngineError, TimeoutError, StarletteHTTPException)


async def handle_exception(conn: Any, exc: Exception) -> Any:
    reply = error_reply(exc)
    if conn.scope["type"] == "websocket":
        await conn.close(code=reply.close_code, reason=reply.message[:120])
        return None
    return reply.response()


def exception_handlers() -> dict:
    return {cls: handle_exception for cls in HANDLED}
