"""`/v1/stream`: a camera session over one websocket (ws on the HTTP port, wss on the TLS port).

The client sends a `config` message holding a decision request, then frames (binary JPEG/PNG
messages, or JSON `{"type": "frame", "image": "data:image/...;base64,..."}`). Each frame becomes
one decision with the frame as its image. One decision is in flight per session and the latest
frame wins: a frame that arrives meanwhile replaces the pending one, and the replaced frame is
reported as dropped in the next result. The protocol is documented in README.md ("Camera sessions").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from app.decisions.errors import RequestError
from app.decisions.request import Decision, parse_decision
from app.engine.base import EngineError, EngineInputError, ImageInput
from app.web.auth import key_matches
from app.web.errors import HTTPError
from app.web.images import check_images

if TYPE_CHECKING:
    from app.server import Services

log = logging.getLogger("djev.stream")

# Close codes (documented in README.md).
CLOSE_AUTH = 1008  # policy violation: no or wrong key
CLOSE_UNSUPPORTED = 1003  # not JSON, not an image, an unknown message type
CLOSE_TOO_BIG = 1009  # a frame or message over the size limit
CLOSE_FLOOD = 4029  # more messages than the rate limit allows
CLOSE_INTERNAL = 1011

AUTH_TIMEOUT_S = 10.0
MAX_TEXT_BYTES = 64 * 1024  # a config or control message; frames sent as JSON may be as large as an image
RATE_PER_SECOND = 60.0
RATE_BURST = 120.0
SUBPROTOCOL = "djev"
BEARER_PREFIX = "bearer."


class Closing(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class RateLimit:
    """Token bucket: RATE_BURST messages at once, RATE_PER_SECOND sustained."""

    def __init__(self, rate: float = RATE_PER_SECOND, burst: float = RATE_BURST) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclasses.dataclass
class _Frame:
    number: int
    image: ImageInput
    received: float


class StreamSession:
    def __init__(self, services: "Services", websocket: WebSocket) -> None:
        self.id = "ws_" + secrets.token_hex(6)
        self.services = services
        self.ws = websocket
        self.decision: Decision | None = None
        self.pending: _Frame | None = None
        self.frames = 0
        self.decided = 0
        self.dropped: list[int] = []
        self.dropped_total = 0
        self.wakeup = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.rate = RateLimit()

    # ------------------------------------------------------------------ sending

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(message, ensure_ascii=False, allow_nan=False))

    async def send_error(self, status: int, message: str, param: str | None = None, frame: int | None = None) -> None:
        error = HTTPError(status, message, param=param)
        await self.send({"type": "error", "frame": frame, "status": status, **error.body()})

    # ------------------------------------------------------------------ receiving

    async def authenticate(self, offered_token: str | None) -> None:
        api_key = self.services.settings.api_key
        if not api_key or key_matches(api_key, offered_token):
            return
        try:
            message = await asyncio.wait_for(self.ws.receive(), AUTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise Closing(CLOSE_AUTH, "authentication required: send {\"type\": \"auth\", \"token\": ...} first") from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        try:
            data = json.loads(message.get("text") or "")
        except ValueError:
            data = None
        if not isinstance(data, dict) or data.get("type") != "auth":
            raise Closing(CLOSE_AUTH, "authentication required: the first message must be {\"type\": \"auth\"}")
        if not key_matches(api_key, data.get("token") if isinstance(data.get("token"), str) else None):
            raise Closing(CLOSE_AUTH, "wrong token")

    async def receive_loop(self) -> None:
        settings = self.services.settings
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if not self.rate.take():
                raise Closing(CLOSE_FLOOD, f"too many messages: at most {RATE_PER_SECOND:.0f} a second")
            if message.get("bytes") is not None:
                data = message["bytes"]
                if len(data) > settings.max_image_bytes:
                    raise Closing(CLOSE_TOO_BIG, f"frame of {len(data)} bytes; the limit is {settings.max_image_bytes}")
                self.offer(self.frame_from_bytes(data, "image/jpeg"))
            elif message.get("text") is not None:
                await self.handle_text(message["text"])

    def frame_from_bytes(self, data: bytes, content_type: str) -> ImageInput:
        self.frames += 1
        image = ImageInput(data=data, content_type=content_type, source=f"frame {self.frames}")
        try:
            check_images([image], self.services.settings.max_image_pixels)
        except HTTPError as exc:
            code = CLOSE_TOO_BIG if exc.status in (400, 413) else CLOSE_UNSUPPORTED
            raise Closing(code, exc.message) from None
        return image

    async def handle_text(self, text: str) -> None:
        settings = self.services.settings
        if len(text) > max(MAX_TEXT_BYTES, settings.max_image_bytes * 4 // 3 + 1024):
            raise Closing(CLOSE_TOO_BIG, "message too large")
        try:
            data = json.loads(text)
        except ValueError:
            raise Closing(CLOSE_UNSUPPORTED, "messages are JSON objects or binary frames") from None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "config":
            await self.configure(data.get("request"))
        elif kind == "frame":
            self.offer(self.frame_from_data_url(data.get("image")))
        elif kind == "ping":
            await self.send({"type": "pong", "t": data.get("t")})
        elif kind == "auth":
            pass  # already authenticated (or no key is set)
        else:
            raise Closing(CLOSE_UNSUPPORTED, f"unknown message type {kind!r}: config, frame, ping or auth")

    def frame_from_data_url(self, url: Any) -> ImageInput:
        if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
            raise Closing(CLOSE_UNSUPPORTED, "a frame message needs image: data:image/...;base64,...")
        header, payload = url.split(",", 1)
        if len(payload) * 3 // 4 > self.services.settings.max_image_bytes:
            raise Closing(CLOSE_TOO_BIG, "frame over the image size limit")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise Closing(CLOSE_UNSUPPORTED, "the frame's base64 does not decode") from None
        return self.frame_from_bytes(data, header[5:].split(";")[0])

    async def configure(self, request: Any) -> None:
        if not isinstance(request, dict):
            await self.send_error(422, "config: request must be a decision request object", "request")
            return
        if request.get("images"):
            await self.send_error(422, "config: images come as frames, not in the config", "request.images")
            return
        try:
            decision = parse_decision(request, self.services.settings.limits)
        except RequestError as exc:
            error = HTTPError.from_request_error(exc)
            await self.send({"type": "error", "frame": None, "status": error.status, **error.body()})
            return
        self.decision = decision
        await self.send({"type": "configured", "questions": [q.qid for q in decision.questions]})

    def offer(self, image: ImageInput) -> None:
        """Latest frame wins: a pending frame not yet decided is replaced and reported dropped."""
        if self.pending is not None:
            self.dropped.append(self.pending.number)
            self.dropped_total += 1
        self.pending = _Frame(number=self.frames, image=image, received=time.monotonic())
        self.wakeup.set()

    # ------------------------------------------------------------------ deciding

    async def decide_loop(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending is not None:
                frame, self.pending = self.pending, None
                try:
                    await self.decide(frame)
                except (asyncio.CancelledError, WebSocketDisconnect, OSError, RuntimeError):
                    raise
                except Exception as exc:  # noqa: BLE001 - one bad frame must not end the session's results
                    log.exception("stream %s: frame %d failed", self.id, frame.number)
                    await self.send_error(500, f"internal error: {type(exc).__name__}", None, frame.number)

    async def decide(self, frame: _Frame) -> None:
        from app.web.systemone import decide, jev_response

        if self.decision is None:
            await self.send_error(409, "send a config message before frames", "config", frame.number)
            return
        started = time.monotonic()
        decision = dataclasses.replace(self.decision, images=(frame.image,))
        try:
            outcome = await decide(self.services, decision, "stream")
        except RequestError as exc:
            error = HTTPError.from_request_error(exc)
            await self.send({"type": "error", "frame": frame.number, "status": error.status, **error.body()})
            return
        except HTTPError as exc:
            await self.send({"type": "error", "frame": frame.number, "status": exc.status, **exc.body()})
            return
        except EngineInputError as exc:
            await self.send_error(exc.status, exc.message, exc.param, frame.number)
            return
        except EngineError as exc:
            await self.send_error(502, f"engine failed: {exc}", None, frame.number)
            return
        done = time.monotonic()
        self.decided += 1
        dropped, self.dropped = self.dropped, []
        await self.send({
            "type": "result",
            "frame": frame.number,
            **jev_response(self.services, outcome),
            "timing": {
                "queue_ms": round((started - frame.received) * 1000, 1),
                "read_ms": round((done - started) * 1000, 1),
                "total_ms": round((done - frame.received) * 1000, 1),
            },
            "dropped": dropped,
            "dropped_total": self.dropped_total,
        })


def _offered(websocket: WebSocket) -> tuple[str | None, str | None]:
    """(subprotocol to accept, bearer token offered as `bearer.<token>`)."""
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    token = next((p[len(BEARER_PREFIX):] for p in offered if p.startswith(BEARER_PREFIX)), None)
    return (SUBPROTOCOL if SUBPROTOCOL in offered else None), token


async def stream(websocket: WebSocket) -> None:
    services: "Services" = websocket.app.state.services
    subprotocol, token = _offered(websocket)
    await websocket.accept(subprotocol=subprotocol)
    session = StreamSession(services, websocket)
    services.sessions[session.id] = session
    decider_task: asyncio.Task | None = None
    try:
        await session.authenticate(token)
        info = services.reader.info
        await session.send({
            "type": "ready", "session": session.id, "model": info.model, "engine": info.engine,
            "device": info.device, "tiny": info.tiny,
            "limits": {"frame_bytes": services.settings.max_image_bytes, "messages_per_second": RATE_PER_SECOND},
        })
        decider_task = asyncio.create_task(session.decide_loop(), name=f"djev-{session.id}")
        await session.receive_loop()
    except Closing as exc:
        log.info("stream %s closed: %s %s", session.id, exc.code, exc.reason)
        try:
            await websocket.close(code=exc.code, reason=exc.reason[:120])
        except (RuntimeError, WebSocketDisconnect, OSError):
            pass
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass
    finally:
        if decider_task is not None:
            decider_task.cancel()
            try:
                await decider_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the session is over either way
                pass
        services.sessions.pop(session.id, None)


routes = [WebSocketRoute("/v1/stream", stream)]
