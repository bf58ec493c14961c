"""The server's logging: one setup, two formats, a request id on every line of a request.

`configure_logging(settings)` sets up the root logger once for `djev serve` (uvicorn logs through
it too). LOG_FORMAT=text gives one readable line per record; LOG_FORMAT=json one JSON object per
line: `time`, `level`, `logger`, `message`, `request_id` when the line was logged inside an HTTP
request, any `extra=` fields, and `exception` with the traceback.

The request id is the one the server answers in `x-typesafe-request-id`; the front door
(app/web/frontdoor.py) puts it in a context variable that tasks and worker threads started by the
request inherit, so every line a request causes carries it.

What is never logged: the API key and request bodies. The server's own log lines name routes,
statuses, question ids and timings only; on top of that, the websocket library's DEBUG lines (the
upgrade request's headers, with the `bearer.<key>` subprotocol, and the first bytes of every
frame) are dropped, and any line that still contains the configured API key has it replaced by
`[redacted]`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import IO, Any

from app.config import Settings

request_id_var: ContextVar[str | None] = ContextVar("djev_request_id", default=None)

REDACTED = "[redacted]"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The attributes every LogRecord has; anything else on a record came from `extra=`. uvicorn's
# `color_message` (the message with terminal colour codes) is not a field worth a JSON key.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id", "color_message"}


class RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the context that logged it (None outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class WireFilter(logging.Filter):
    """Drops records below INFO logged by the websocket library's own code: they print the upgrade
    request's headers and the first bytes of each frame. uvicorn hands that library its own
    `uvicorn.error` logger, so the filter goes by the file that logged, not the logger's name."""

    def __init__(self) -> None:
        super().__init__()
        import websockets

        self.prefix = os.path.dirname(os.path.abspath(websockets.__file__)) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or not os.path.abspath(record.pathname).startswith(self.prefix)


class RedactFilter(logging.Filter):
    """Replaces `secret` in the rendered message (a safety net: nothing of ours logs the key)."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secret:
            return True
        message = record.getMessage()
        if self.secret in message:
            record.msg, record.args = message.replace(self.secret, REDACTED), None
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message [request_id]`."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        if not request_id:
            return line
        first, newline, rest = line.partition("\n")  # the id ends the first line, before a traceback
        return f"{first} [{request_id}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def make_handler(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """The handler `configure_logging` installs: LOG_FORMAT's formatter, the request id, redaction."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.logs.log_format == "json" else TextFormatter())
    handler.addFilter(WireFilter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactFilter(settings.server.api_key))
    return handler


def configure_logging(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """Route every logger through one handler on the root at LOG_LEVEL, in LOG_FORMAT. Replaces any
    handler a previous call (or `logging.basicConfig`) installed on the root. Returns the handler."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    handler = make_handler(settings, stream)
    root.addHandler(handler)
    root.setLevel(settings.logs.log_level.upper())
    return handler
