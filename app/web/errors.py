"""One error envelope for every route, readable by the reference's clients and by Jev's:

    {"error": {"message", "type", "param"}, "detail": ...}

`detail` is FastAPI's list `[{"loc": ["body", ...], "msg", "type"}]` for a 422 and
`{"error_type", "message"}` otherwise; where Jev answers a limit with a plain-string detail
("Too many choices. ..."), that string is the detail.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from app.decisions.errors import RequestError

DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    529: "overloaded_error",
}


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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    """JSON with non-ASCII kept (option names and ids come back byte for byte) and no NaN."""
    return _Json(payload, status_code=status, headers=headers)


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
