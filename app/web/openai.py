"""OpenAI-shaped routes, as the reference serves them:

- `POST /v1/chat/completions`: the same decision, the schema JSON as the system message and the state
  as the user message; the reply's content is the answer JSON (the reference's own answer shape).
- `POST /v1/raw/chat/completions`: plain generation through the same engine and port (and, with
  API_KEY, the same token): the conversation rendered with the checkpoint's chat template, the reply
  written by the diffusion sampler.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.decisions.chat import chat_to_body, message_text
from app.decisions.errors import RequestError
from app.decisions.request import parse_decision
from app.engine.base import GenerateSpec, Prompt
from app.web.body import read_payload
from app.web.errors import HTTPError, json_response
from app.web.systemone import decide, services

if TYPE_CHECKING:
    from app.server import Services

RAW_DEFAULT_MAX_TOKENS = 256
RAW_MAX_TOKENS = 4096
RAW_ROLES = ("system", "developer", "user", "assistant")


def completion(svc: "Services", model: Any, content: str, prompt_tokens: int, completion_tokens: int,
               finish_reason: str = "stop") -> dict:
    now = time.time()
    return {
        "id": f"chatcmpl-{int(now * 1000)}",
        "object": "chat.completion",
        "created": int(now),
        "model": model if isinstance(model, str) and model else svc.reader.info.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


async def chat_completions(request: Request) -> Response:
    svc = services(request)
    payload = await read_payload(request, svc.settings.max_body_bytes)
    try:
        decision = parse_decision(chat_to_body(payload.body), svc.settings.limits)
    except RequestError as exc:
        # The chat form answers every refusal with 400, as the reference does.
        raise HTTPError(400 if exc.status == 422 else exc.status, exc.message, param=exc.param) from None
    svc.check_images(decision)
    outcome = await decide(svc, decision, "structured")
    content = json.dumps({"answers": outcome.internal_answers, "diagnostics": outcome.diagnostics},
                         indent=2, ensure_ascii=False, allow_nan=False)
    model = payload.body.get("model") if isinstance(payload.body, dict) else None
    return json_response(completion(svc, model, content, outcome.input_tokens, outcome.output_tokens))


def _raw_messages(body: Any) -> list[tuple[str, str]]:
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise HTTPError(422, "messages: needs a non-empty list of {role, content}", param="messages", loc=("messages",))
    messages = []
    for index, message in enumerate(body["messages"]):
        if not isinstance(message, dict) or message.get("role") not in RAW_ROLES:
            raise HTTPError(422, f"messages[{index}]: role must be one of {', '.join(RAW_ROLES)}",
                            param=f"messages.{index}.role", loc=("messages", index, "role"))
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            raise HTTPError(422, f"messages[{index}]: raw generation takes text only", param=f"messages.{index}.content",
                            loc=("messages", index, "content"))
        if not isinstance(content, (str, list)):
            raise HTTPError(422, f"messages[{index}]: content must be a string or text parts",
                            param=f"messages.{index}.content", loc=("messages", index, "content"))
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append((role, message_text(content)))
    return messages


def _bounded_int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HTTPError(422, f"{key}: must be an integer from {low} to {high}", param=key, loc=(key,))
    return value


async def raw_chat_completions(request: Request) -> Response:
    svc = services(request)
    payload = await read_payload(request, svc.settings.max_body_bytes)
    body = payload.body
    messages = _raw_messages(body)
    max_tokens = _bounded_int(body, "max_tokens", RAW_DEFAULT_MAX_TOKENS, 1, RAW_MAX_TOKENS)
    seed = _bounded_int(body, "seed", 42, -(2**63) + 1, 2**63 - 1)
    tokenizer = svc.reader.tokenizer
    ids = tuple(tokenizer.render_messages(messages, 0, thinking=False))
    stops = (tokenizer.turn_close_id,)
    with svc.admission.slot():
        result = await svc.reader.generate(GenerateSpec(Prompt(ids), max_tokens, stops, seed))
    text = tokenizer.decode(result.ids)
    return json_response(completion(svc, body.get("model"), text, result.prompt_tokens, len(result.ids),
                                    "stop" if result.stopped else "length"))


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/raw/chat/completions", raw_chat_completions, methods=["POST"]),
]
