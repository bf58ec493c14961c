"""`POST /v1/raw/chat/completions`: plain generation through the same engine and port (and, with
API_KEY, the same token).

On the hf engine the conversation is rendered with the checkpoint's chat template and the reply is
written by the diffusion sampler, with `temperature`, `top_p`, `stop`, `seed` and `max_tokens`
honoured and `stream` sent as OpenAI's server-sent events (app/web/raw_request.py reads the body).
A reader that relays chat completions (the vLLM engines) gets the body unchanged instead, and its
answer, streamed or whole, goes back as it came.

Either way the generation is admitted by its cost (`max_tokens`), bounded by REQUEST_TIMEOUT and
cancelled when the client leaves.
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.engine.base import ChatRelay, GenerateSpec, Prompt
from app.web.body import RawBody, parse_payload, read_raw
from app.web.errors import ClientGone, HTTPError, error_reply, json_response
from app.web.openai import completion, usage
from app.web.raw_request import RAW_DEFAULT_MAX_TOKENS, RawRequest, StopCutter, cut_at_stop, parse_raw
from app.web.services import Services, services
from app.web.work import guarded

# (status, media type, body chunks) of a response about to start.
Opened = tuple[int, str, AsyncIterator[bytes]]


class Streamed(Response):
    """A response whose body is produced while the work runs: admitted by `cost` for its whole life,
    under REQUEST_TIMEOUT, cancelled when the client leaves. A failure before the first byte is an
    ordinary error response; after it, an SSE `error` event ends the stream."""

    def __init__(self, svc: Services, cost: int, open_stream: Callable[[], Awaitable[Opened]]) -> None:
        super().__init__()
        self.svc, self.cost, self.open_stream = svc, cost, open_stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def pump() -> None:
            nonlocal started
            status, media_type, chunks = await self.open_stream()
            async with _closing(chunks):
                async for data in chunks:
                    if not started:
                        headers = [(b"content-type", media_type.encode("latin-1")), (b"cache-control", b"no-store")]
                        await send({"type": "http.response.start", "status": status, "headers": headers})
                        started = True
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            if not started:
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", media_type.encode("latin-1"))]})
                started = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        with self.svc.admission.admit(self.cost):
            try:
                await guarded(self.svc, pump, receive)
            except Exception as exc:
                if not started:
                    raise
                if isinstance(exc, ClientGone):
                    return
                reply = error_reply(exc)
                event = json.dumps({**reply.envelope, "status": reply.status}, ensure_ascii=False)
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": False})


def _sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n\n"


def _prepare(svc: Services, raw: RawBody) -> tuple[RawRequest, tuple[int, ...]]:
    """Parse and read the body and render the prompt (blocking: worker pool, whatever the body's
    size: the conversation's shape is the client's, and a new one renders the chat template under
    the tokenizer's lock)."""
    request = parse_raw(parse_payload(raw, svc.settings.limits.max_body_bytes).body, svc.settings.decisions.default_seed)
    ids = tuple(svc.reader.tokenizer.render_messages(list(request.messages), 0, thinking=False))
    return request, ids


def _spec(svc: Services, request: RawRequest, ids: tuple[int, ...]) -> GenerateSpec:
    return GenerateSpec(Prompt(ids), request.max_tokens, (svc.reader.tokenizer.turn_close_id,), request.seed,
                        temperature=request.temperature, top_p=request.top_p)


def _served_model(svc: Services, request: RawRequest) -> str:
    return request.model or svc.reader.info.model


class _Reply:
    """The fields every chunk of one streamed reply shares."""

    def __init__(self, svc: Services, request: RawRequest) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = _served_model(svc, request)

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra: Any) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}


async def raw_chat_completions(request: Request) -> Response:
    svc = services(request)
    raw = await read_raw(request, svc.settings.limits.max_body_bytes)
    if isinstance(svc.reader, ChatRelay):
        payload = await svc.prepare(parse_payload, raw.inline_size, raw, svc.settings.limits.max_body_bytes)
        return await _relay(svc, request, svc.reader.relay_chat, payload.body)
    parsed, ids = await svc.offload(_prepare, svc, raw)
    svc.admission.check_fits(parsed.max_tokens, "max_tokens")
    spec = _spec(svc, parsed, ids)
    if parsed.stream:
        return Streamed(svc, parsed.max_tokens, lambda: _open_events(svc, parsed, spec))
    with svc.admission.admit(parsed.max_tokens):
        result = await guarded(svc, lambda: svc.reader.generate(spec), request.receive)
    # The decode takes the tokenizer's lock, which a worker rendering a template may hold: off the
    # loop (one trip, against a generation of many passes). A stream's per-chunk decodes stay on the
    # loop: a trip per chunk would cost more than the short wait they may meet.
    text, cut = cut_at_stop(await svc.offload(svc.reader.tokenizer.decode, result.ids), parsed.stop)
    return json_response(completion(_served_model(svc, parsed), text, result.prompt_tokens, len(result.ids),
                                    "stop" if cut or result.stopped else "length"))


async def _open_events(svc: Services, request: RawRequest, spec: GenerateSpec) -> Opened:
    """Start the generation and wait for its first chunk, so that a reader failing at once is an
    ordinary error response; then the events."""
    chunks = svc.reader.stream(spec).__aiter__()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        async with _closing(chunks):
            raise
    return 200, "text/event-stream", _events(svc, request, first, chunks)


async def _events(svc: Services, request: RawRequest, first: Any, chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    reader = svc.reader
    reply = _Reply(svc, request)
    extra = {"usage": None} if request.include_usage else {}
    cutter = StopCutter(request.stop)
    ids: list[int] = []
    sent_text = ""
    last = first
    yield _sse(reply.chunk({"role": "assistant", "content": ""}, **extra))
    async with _closing(chunks):
        chunk = first
        while chunk is not None:
            last = chunk
            ids.extend(chunk.ids)
            # Decode the whole reply each time (at most RAW_MAX_TOKENS ids, about a millisecond): a
            # token may end inside a character that the next completes (held while it ends in U+FFFD).
            text = reader.tokenizer.decode(ids)
            if not chunk.done and text.endswith("\ufffd"):
                new = ""
            else:
                new, sent_text = text[len(sent_text):], text
            piece = cutter.feed(new)
            if piece:
                yield _sse(reply.chunk({"content": piece}, **extra))
            if cutter.stopped or chunk.done:
                break
            chunk = await anext(chunks, None)
    tail = cutter.finish()
    if tail:
        yield _sse(reply.chunk({"content": tail}, **extra))
    stopped = cutter.stopped or bool(last is not None and last.stopped)
    yield _sse(reply.chunk({}, "stop" if stopped else "length", **extra))
    if request.include_usage:
        prompt_tokens = last.prompt_tokens if last is not None else 0
        yield _sse({**reply.chunk({}), "choices": [], "usage": usage(prompt_tokens, len(ids))})
    yield b"data: [DONE]\n\n"


async def _relay(svc: Services, request: Request, relay: Callable[[dict], Awaitable[Any]], body: Any) -> Response:
    """The body goes to the upstream unchanged; its answer comes back as it came."""
    if not isinstance(body, dict):
        raise HTTPError(422, "body: must be a JSON object with messages", param="body")
    cost = body.get("max_completion_tokens") or body.get("max_tokens") or RAW_DEFAULT_MAX_TOKENS
    cost = cost if isinstance(cost, int) and not isinstance(cost, bool) and cost > 0 else RAW_DEFAULT_MAX_TOKENS
    svc.admission.check_fits(cost, "max_tokens")

    async def open_upstream() -> Opened:
        answer = await relay(body)
        return answer.status, answer.media_type, answer.chunks if answer.chunks is not None else _once(answer.body)

    return Streamed(svc, cost, open_upstream)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


@asynccontextmanager
async def _closing(iterator: AsyncIterator[Any]) -> AsyncIterator[None]:
    """Close an async iterator however the block ends (a reader's stream drops its work when
    closed), shielded so that a cancellation in progress cannot skip the close."""
    try:
        yield
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()


routes = [Route("/v1/raw/chat/completions", raw_chat_completions, methods=["POST"])]
