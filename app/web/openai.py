"""`POST /v1/chat/completions`, the reference's chat form of a decision: the schema JSON as the
system message and the state as the user message; the reply's content is the answer JSON (the
reference's own answer shape). Every refusal here is a 400, as the reference answers. Raw
generation (`/v1/raw/chat/completions`) is app/web/raw.py.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.decisions.outcome import Outcome
from app.web.answers import chat_content
from app.web.body import read_raw
from app.web.errors import error_reply, render_json
from app.web.services import services
from app.web.work import decide, options_in, prepare, rendered


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(model: str, content: str, prompt_tokens: int, completion_tokens: int,
               finish_reason: str = "stop") -> dict:
    """An OpenAI `chat.completion` body: the chat form's reply here and raw generation's whole reply
    (app/web/raw.py), written in this one place."""
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


async def chat_completions(request: Request) -> Response:
    svc = services(request)
    try:
        raw = await read_raw(request, svc.settings.limits.max_body_bytes)
        prepared = await svc.prepare(prepare, raw.inline_size, svc, raw, True)
        outcome = await decide(svc, prepared, "structured", request.receive)
    except Exception as exc:  # noqa: BLE001 - every failure goes through the one map, refusals as 400
        return error_reply(exc, refusal_status=400).response()
    model: Any = prepared.body.get("model") if isinstance(prepared.body, dict) else None
    served = model if isinstance(model, str) and model else svc.reader.info.model
    # The content is the answers as indented JSON text, then the completion as JSON: rendered together.
    body = await rendered(svc, options_in(prepared.decision), _completion_json, served, outcome)
    return Response(body, media_type="application/json")


def _completion_json(model: str, outcome: Outcome) -> bytes:
    return render_json(completion(model, chat_content(outcome), outcome.input_tokens, outcome.output_tokens))


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
