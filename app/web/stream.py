"""`/v1/stream`: a camera session over one websocket (ws on the HTTP port, wss on the TLS port).

The client sends a `config` message holding a decision request, then frames (binary JPEG/PNG
messages, or JSON `{"type": "frame", "image": "data:image/...;base64,..."}`). Each frame becomes
one decision with the frame as its image. One decision is in flight per session and the latest
frame wins: a frame that arrives meanwhile replaces the pending one, and the replaced frame is
reported as dropped in the next result. The protocol is documented in docs/wire.md §10.

A session's two loops (receiving, deciding) run in one task group: when either fails, the other is
cancelled and the socket closes with 1011 and a reason, so no session keeps taking frames it will
never answer. At most MAX_SESSIONS sessions are open at once; one more is closed with 1013, and
so is every session opened while the model is starting.
Errors reach the client through the same map as every REST route (app/web/errors.py).

Pacing (app/web/pacing.py): once authenticated, a session is admitted only while the camera
capacity the engine has shown leaves MIN_SESSION_FPS for one more (else 1013, before `ready`, with a
reason naming the load); `ready` and every `result` carry `next_frame_ms`, the interval the client
should send its next frame at; each answered frame's timings feed the pacer's estimate. An admitted
session is never closed for load.
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
from typing import Any

import anyio
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from app.decisions.plan import Plan
from app.decisions.request import Decision, parse_decision
from app.engine.base import ImageInput
from app.engine.starting import StartingReader
from app.web.answers import jev_body
from app.web.auth import key_matches
from app.web.errors import (
    CLOSE_AUTH,
    CLOSE_FLOOD,
    CLOSE_TOO_BIG,
    CLOSE_TRY_LATER,
    CLOSE_UNSUPPORTED,
    HTTPError,
    error_reply,
)
from app.web.images import check_images
from app.web.services import Services
from app.web.work import Prepared, decide, priced_plan, unwrap

log = logging.getLogger("djev.stream")

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
    interval_ms: int  # the next_frame_ms the session had been told when this frame arrived


class StreamSession:
    def __init__(self, services: Services, websocket: WebSocket) -> None:
        self.id = "ws_" + secrets.token_hex(6)
        self.services = services
        self.ws = websocket
        self.decision: Decision | None = None
        # The plan of the configured decision with a frame, made at its first frame and kept for the
        # next ones: a plan reads only how many images a decision has, never their bytes.
        self.planned: tuple[Decision, Plan] | None = None
        self.pending: _Frame | None = None
        self.frames = 0
        self.decided = 0
        self.dropped: list[int] = []
        self.dropped_total = 0
        self.wakeup = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.rate = RateLimit()
        self.interval_ms = services.pacer.next_frame_ms()  # the next_frame_ms last sent to the client

    # ------------------------------------------------------------------ sending

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(message, ensure_ascii=False, allow_nan=False))

    async def send_error(self, exc: BaseException, frame: int | None = None) -> None:
        """An error that does not end the session, as the error map says (status and envelope); a
        frame's error carries next_frame_ms as a result does."""
        reply = error_reply(exc)
        paced = {} if frame is None else {"next_frame_ms": self.interval_ms}
        await self.send({"type": "error", "frame": frame, "status": reply.status, **reply.envelope, **paced})

    # ------------------------------------------------------------------ receiving

    async def authenticate(self, offered_token: str | None) -> None:
        api_key = self.services.settings.server.api_key
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
                if len(data) > settings.limits.max_image_bytes:
                    raise Closing(CLOSE_TOO_BIG, f"frame of {len(data)} bytes; the limit is {settings.limits.max_image_bytes}")
                self.offer(await self.frame_from_bytes(data, "image/jpeg"))
            elif message.get("text") is not None:
                await self.handle_text(message["text"])

    async def frame_from_bytes(self, data: bytes, content_type: str) -> ImageInput:
        self.frames += 1
        image = ImageInput(data=data, content_type=content_type, source=f"frame {self.frames}")
        try:
            await self.services.offload(check_images, [image], self.services.settings.limits.max_image_pixels)
        except HTTPError as exc:
            code = CLOSE_TOO_BIG if exc.status in (400, 413) else CLOSE_UNSUPPORTED
            raise Closing(code, exc.message) from None
        return image

    async def handle_text(self, text: str) -> None:
        settings = self.services.settings
        if len(text) > max(MAX_TEXT_BYTES, settings.limits.max_image_bytes * 4 // 3 + 1024):
            raise Closing(CLOSE_TOO_BIG, "message too large")
        try:
            # A frame sent as a data URL is megabytes of JSON: parsed in the worker pool.
            data = json.loads(text) if len(text) <= MAX_TEXT_BYTES else await self.services.offload(json.loads, text)
        except ValueError:
            raise Closing(CLOSE_UNSUPPORTED, "messages are JSON objects or binary frames") from None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "config":
            await self.configure(data.get("request"))
        elif kind == "frame":
            self.offer(await self.frame_from_data_url(data.get("image")))
        elif kind == "ping":
            await self.send({"type": "pong", "t": data.get("t")})
        elif kind == "auth":
            pass  # already authenticated (or no key is set)
        else:
            # The reason is logged: it names no client text (no request content in any log).
            raise Closing(CLOSE_UNSUPPORTED, "unknown message type: the types are config, frame, ping and auth")

    async def frame_from_data_url(self, url: Any) -> ImageInput:
        if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
            raise Closing(CLOSE_UNSUPPORTED, "a frame message needs image: data:image/...;base64,...")
        header, payload = url.split(",", 1)
        if len(payload) * 3 // 4 > self.services.settings.limits.max_image_bytes:
            raise Closing(CLOSE_TOO_BIG, "frame over the image size limit")
        try:
            data = await self.services.offload(_b64decode, payload)
        except (binascii.Error, ValueError):
            raise Closing(CLOSE_UNSUPPORTED, "the frame's base64 does not decode") from None
        return await self.frame_from_bytes(data, header[5:].split(";")[0])

    async def configure(self, request: Any) -> None:
        if not isinstance(request, dict):
            await self.send_error(HTTPError(422, "config: request must be a decision request object", param="request"))
            return
        if request.get("images"):
            await self.send_error(HTTPError(422, "config: images come as frames, not in the config",
                                            param="request.images"))
            return
        try:
            decision = await self.services.offload(parse_decision, request, self.services.limits)
        except Exception as exc:  # noqa: BLE001 - a bad config is reported; the session stays open
            await self.send_error(exc)
            return
        self.decision = decision
        await self.send({"type": "configured", "questions": [q.qid for q in decision.questions]})

    def offer(self, image: ImageInput) -> None:
        """Latest frame wins: a pending frame not yet decided is replaced and reported dropped."""
        if self.pending is not None:
            self.dropped.append(self.pending.number)
            self.dropped_total += 1
            self.services.metrics.frame_dropped()
        self.pending = _Frame(number=self.frames, image=image, received=time.monotonic(), interval_ms=self.interval_ms)
        self.wakeup.set()

    # ------------------------------------------------------------------ deciding

    async def decide_loop(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending is not None:
                frame, self.pending = self.pending, None
                await self.decide(frame)

    async def decide(self, frame: _Frame) -> None:
        if self.decision is None:
            await self.send_error(HTTPError(409, "send a config message before frames", param="config"), frame.number)
            return
        started = time.monotonic()
        configured = self.decision
        decision = dataclasses.replace(configured, images=(frame.image,))
        try:
            # The frame was checked when it arrived (frame_from_bytes): only the plan is made here,
            # once per config.
            if self.planned is not None and self.planned[0] is configured:
                plan = self.planned[1]
            else:
                plan = await self.services.offload(priced_plan, self.services, decision)
                self.planned = (configured, plan)
            outcome = await decide(self.services, Prepared(decision, plan, None), "stream")
        except Exception as exc:  # noqa: BLE001 - a frame that fails is reported; the session goes on
            await self.send_error(exc, frame.number)
            return
        done = time.monotonic()
        self.decided += 1
        self.pace(frame, done)
        dropped, self.dropped = self.dropped, []
        await self.send({
            "type": "result",
            "frame": frame.number,
            **jev_body(self.services.reader.info.model, outcome),
            "timing": {
                "queue_ms": round((started - frame.received) * 1000, 1),
                "read_ms": round((done - started) * 1000, 1),
                "total_ms": round((done - frame.received) * 1000, 1),
            },
            "dropped": dropped,
            "dropped_total": self.dropped_total,
            "next_frame_ms": self.interval_ms,
        })

    def pace(self, frame: _Frame, done: float) -> None:
        """Feed the pacer one answered frame (a newer frame already waiting means the client is ahead
        of the engine), and take the interval to send with its result."""
        pacer, metrics = self.services.pacer, self.services.metrics
        age = done - frame.received
        window = pacer.answered(done, age, frame.interval_ms, waiting=self.pending is not None,
                                busy_ms=engine_busy_ms(self.services.reader))
        if window is not None:
            log.debug("camera pacing: %d answers in %.1f s (%d engine-bound): %s; capacity %.1f, pace %.1f frames/s",
                      window.answers, window.seconds, window.engine_bound, window.verdict, window.capacity, window.pace)
        self.interval_ms = pacer.next_frame_ms()
        metrics.frame_decided(age)
        metrics.frame_paced(age, self.interval_ms)
        metrics.paced(pacer.capacity, pacer.pace, self.interval_ms)


def engine_busy_ms(reader: object) -> float | None:
    """The engine's busy milliseconds so far, where the reader counts them (the hf engine's
    `busy_ms` stat), for the pacer; None for a reader that does not (or whose stats fail)."""
    try:
        value = getattr(reader, "stats", {}).get("busy_ms")
    except Exception:  # noqa: BLE001 - a broken stats property must not end a camera session
        return None
    return float(value) if value is not None else None


def _b64decode(payload: str) -> bytes:
    return base64.b64decode(payload, validate=True)


def _offered(websocket: WebSocket) -> tuple[str | None, str | None]:
    """(subprotocol to accept, bearer token offered as `bearer.<token>`)."""
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    token = next((p[len(BEARER_PREFIX):] for p in offered if p.startswith(BEARER_PREFIX)), None)
    return (SUBPROTOCOL if SUBPROTOCOL in offered else None), token


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    try:
        await websocket.close(code=code, reason=reason[:120])
    except (RuntimeError, WebSocketDisconnect, OSError):
        pass  # the client is gone already


async def supervise(session: StreamSession) -> None:
    """Both loops in one task group: the client leaving ends the receive loop and so the session;
    a failure of either loop cancels the other and propagates."""
    async with anyio.create_task_group() as group:
        group.start_soon(session.decide_loop, name=f"djev-{session.id}-decide")
        await session.receive_loop()
        group.cancel_scope.cancel()


async def stream(websocket: WebSocket) -> None:
    services: Services = websocket.app.state.services
    subprotocol, token = _offered(websocket)
    await websocket.accept(subprotocol=subprotocol)
    if isinstance(services.reader, StartingReader) and not services.reader.ready:
        # The model is loading (or failed to): 1013, try again later, with the phase, as the error map says.
        reply = error_reply(services.reader.unavailable())
        await _close(websocket, reply.close_code, reply.message)
        return
    limit = services.max_sessions
    if len(services.sessions) >= limit:
        services.metrics.session_opened("refused_max_sessions")
        await _close(websocket, CLOSE_TRY_LATER, f"too many camera sessions: at most {limit}; try again later")
        return
    session = StreamSession(services, websocket)
    services.sessions[session.id] = session
    admitted = False
    try:
        await session.authenticate(token)
        admit(services, session)
        admitted = True
        info = services.reader.info
        await session.send({
            "type": "ready", "session": session.id, "model": info.model, "engine": info.engine,
            "device": info.device, "tiny": info.tiny, "replica": services.settings.server.replica_id or None,
            "next_frame_ms": session.interval_ms,
            "limits": {"frame_bytes": services.settings.limits.max_image_bytes, "messages_per_second": RATE_PER_SECOND},
        })
        await supervise(session)
    except Exception as raised:  # noqa: BLE001 - every way a session ends is handled here
        exc = unwrap(raised)
        if isinstance(exc, Closing):
            log.info("stream %s closed: %s %s", session.id, exc.code, exc.reason)
            await _close(websocket, exc.code, exc.reason)
        elif not isinstance(exc, (WebSocketDisconnect, OSError)):
            reply = error_reply(exc)  # logs a bug with its traceback
            log.warning("stream %s failed: %s", session.id, reply.message)
            await _close(websocket, reply.close_code, f"session failed: {reply.message}")
    finally:
        services.sessions.pop(session.id, None)
        if admitted:
            services.pacer.leave(session.id)
            services.metrics.paced(services.pacer.capacity, services.pacer.pace, services.pacer.next_frame_ms())


def admit(services: Services, session: StreamSession) -> None:
    """Admit `session` to the pacer, or raise the 1013 that names the load."""
    pacer = services.pacer
    verdict = pacer.admit(session.id)
    if not verdict.admitted:
        services.metrics.session_opened("refused_load")
        raise Closing(CLOSE_TRY_LATER, verdict.reason)
    services.metrics.session_opened("admitted")
    session.interval_ms = pacer.next_frame_ms()
    services.metrics.paced(pacer.capacity, pacer.pace, session.interval_ms)


routes = [WebSocketRoute("/v1/stream", stream)]
