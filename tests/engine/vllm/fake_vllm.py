"""A fake vLLM OpenAI server for the remote engine's tests, run as its own process so it can really
die mid-request: `python -m tests.engine.vllm.fake_vllm PORT MODE`.

Modes (switch with POST /_mode {"mode": ...}): ok, garbage (200 with a body that is not JSON),
badshape (200 JSON without logprobs), hang (never answers; notices when the client goes away),
die (the process exits while a request is open), error500, error400, slow (ok after 0.3 s),
rerender (a chat read says it rendered the prompt as other ids than djev's).
GET /_state says what it saw: the request bodies, requests still open, requests whose client left.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

STATE: dict = {"mode": "ok", "bodies": [], "open": 0, "client_left": 0}


def fake_logprob(token_id: int, position: int) -> float:
    """The logprob the fake gives a label id at a canvas position (tests recompute it)."""
    return -0.25 * (1 + (token_id + position) % 7)


def argmax_at(position: int) -> int:
    return 1000 + position


def completion_answer(body: dict) -> dict:
    width = int(body["max_tokens"])
    ids = body.get("logprob_token_ids") or []
    tops = [{f"token_id:{i}": fake_logprob(i, p) for i in ids} for p in range(width)]
    return {
        "id": "cmpl-fake", "object": "text_completion", "model": "fake",
        "choices": [{"index": 0, "text": "", "finish_reason": "length",
                     "logprobs": {"tokens": [f"token_id:{argmax_at(p)}" for p in range(width)],
                                  "token_logprobs": [-0.1] * width, "top_logprobs": tops,
                                  "text_offset": [0] * width}}],
        "usage": {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": width,
                  "total_tokens": width},
    }


async def _misbehave(request: Request) -> Response | None:
    mode = STATE["mode"]
    if mode == "garbage":
        return PlainTextResponse("<html>proxy error</html>", status_code=200)
    if mode == "badshape":
        return JSONResponse({"choices": [{"text": "hello"}], "usage": {"prompt_tokens": 1}})
    if mode == "error500":
        return JSONResponse({"error": {"message": "engine crashed"}}, status_code=500)
    if mode == "error400":
        return JSONResponse({"error": {"message": "bad field"}}, status_code=400)
    if mode == "die":
        os._exit(3)
    if mode == "hang":
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        STATE["client_left"] += 1
        return Response(status_code=499)
    if mode == "slow":
        await asyncio.sleep(0.3)
    return None


async def completions(request: Request) -> Response:
    body = await request.json()
    STATE["bodies"].append(body)
    STATE["open"] += 1
    try:
        bad = await _misbehave(request)
        if bad is not None:
            return bad
        if body.get("stream"):
            return StreamingResponse(_generation_events(body), media_type="text/event-stream")
        return JSONResponse(completion_answer(body))
    finally:
        STATE["open"] -= 1


async def _generation_events(body: dict):
    prompt = body.get("prompt") or []
    blocks = [[50, 51, 52], [53, 54], [int((body.get("stop_token_ids") or [7])[0]), 60]]
    for index, block in enumerate(blocks):
        choice = {"index": 0, "text": "", "token_ids": block,
                  "finish_reason": "stop" if index == len(blocks) - 1 else None}
        if index == 0:
            choice["prompt_token_ids"] = prompt
        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        await asyncio.sleep(0.01)
    yield "data: [DONE]\n\n"


async def chat(request: Request) -> Response:
    body = await request.json()
    STATE["bodies"].append(body)
    bad = await _misbehave(request)
    if bad is not None:
        return bad
    if body.get("stream"):
        async def events():
            for word in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    if body.get("logprob_token_ids"):
        answer = chat_read_answer(body)
        if STATE["mode"] == "rerender":
            answer["prompt_token_ids"] = [1, 2, 3]  # as `return_token_ids` reports them; never a djev prompt
        return JSONResponse(answer)
    return JSONResponse({"object": "chat.completion", "echo": body}, status_code=200)


def chat_read_answer(body: dict) -> dict:
    """A chat-route read: one content entry per canvas position, the label ids as top_logprobs."""
    width = int(body["max_tokens"])
    ids = body["logprob_token_ids"]
    content = [{"token": f"token_id:{argmax_at(p)}", "logprob": -0.1,
                "top_logprobs": [{"token": f"token_id:{i}", "logprob": fake_logprob(i, p)} for i in ids]}
               for p in range(width)]
    return {"object": "chat.completion", "choices": [{"index": 0, "logprobs": {"content": content},
                                                      "finish_reason": "length"}],
            "usage": {"prompt_tokens": 77}}


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def set_mode(request: Request) -> Response:
    STATE["mode"] = (await request.json())["mode"]
    return JSONResponse({"mode": STATE["mode"]})


async def state(request: Request) -> Response:
    return JSONResponse({k: STATE[k] for k in ("mode", "bodies", "open", "client_left")})


app = Starlette(routes=[
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/_mode", set_mode, methods=["POST"]),
    Route("/_state", state, methods=["GET"]),
])

if __name__ == "__main__":
    STATE["mode"] = sys.argv[2] if len(sys.argv) > 2 else "ok"
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
