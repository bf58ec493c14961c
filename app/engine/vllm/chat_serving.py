"""vLLM's own OpenAI chat serving, in this process, over the `vllm` engine's AsyncLLM: what the raw
chat route relays a body to, unchanged, streaming included (the in-process counterpart of relaying
to a vLLM server's `/v1/chat/completions`).

It is built with vLLM's own server set-up (`init_app_state`) from the same flags as the engine, so
chat templates, reasoning and tool parsers and the served model name behave as in `vllm serve`.
vLLM's answer comes back as vLLM's HTTP route would send it: its JSON with its status, or its
server-sent events.
"""

from __future__ import annotations

import json
from argparse import Namespace
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, AsyncIterator

from app.engine.base import EngineError, RelayedResponse

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient  # pyright: ignore[reportMissingImports]  # optional: vLLM
    from vllm.entrypoints.openai.chat_completion.serving import (  # pyright: ignore[reportMissingImports]  # optional: vLLM
        OpenAIServingChat,
    )


class InProcessChat:
    def __init__(self, serving_chat: OpenAIServingChat) -> None:
        self.serving_chat = serving_chat

    @classmethod
    async def build(cls, engine: EngineClient, args: Namespace) -> "InProcessChat":
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import (  # pyright: ignore[reportMissingImports]  # optional: vLLM
            init_app_state,
        )

        state = State()
        tasks = await engine.get_supported_tasks()
        await init_app_state(engine, state, args, tasks)
        serving_chat = getattr(state, "openai_serving_chat", None)
        if serving_chat is None:
            raise EngineError("vLLM set up no chat completions serving for this model")
        return cls(serving_chat)

    async def relay(self, body: dict) -> RelayedResponse:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import (  # pyright: ignore[reportMissingImports]  # optional: vLLM
            ChatCompletionRequest,
            ChatCompletionResponse,
        )

        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            return _error(400, f"invalid chat completions request: {exc.errors()[:3]}")
        except ValueError as exc:  # vLLM's own request checks raise plain ValueErrors
            return _error(400, str(exc))
        answer = await self.serving_chat.create_chat_completion(request, None)
        if isinstance(answer, ChatCompletionResponse):
            return RelayedResponse(status=200, media_type="application/json", body=answer.model_dump_json().encode())
        if not isinstance(answer, AsyncGenerator):  # vLLM's ErrorResponse
            return RelayedResponse(status=int(answer.error.code or 400), media_type="application/json",
                                   body=answer.model_dump_json().encode())
        return RelayedResponse(status=200, media_type="text/event-stream", chunks=_encoded(answer))


async def _encoded(events: AsyncIterator[str]) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.encode()


def _error(status: int, message: str) -> RelayedResponse:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return RelayedResponse(status=status, media_type="application/json", body=json.dumps(body).encode())
