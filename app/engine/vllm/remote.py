"""Engine `remote`: the same reads sent to running vLLM OpenAI servers over HTTP.

A read is one `POST /v1/completions` per canvas (per group of at most 128 label ids; see
app/engine/vllm/wire.py) with the prompt as token ids, so no chat template is applied twice; a read
with images goes through `/v1/chat/completions` as the conversation djev rendered
(app/engine/vllm/chat.py), since vLLM's completions route takes no images. Every canvas of a call to
`read()` is sent at once.

Routing, health checks, the retry elsewhere and the errors naming an upstream:
app/engine/vllm/upstreams.py.

The tokenizer is the checkpoint's own, loaded from --model: templates are built here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence, TypeVar

import httpx

from app.engine.base import (
    ChatTokenizer,
    EngineError,
    EngineInputError,
    GenerateChunk,
    GenerateResult,
    GenerateSpec,
    Prompt,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    RelayedResponse,
    UpstreamState,
    collect,
    describe,
    gather_or_cancel,
)
from app.engine.vllm.chat import ChatFormer
from app.engine.vllm.checkpoint import CheckpointConfig, load_tokenizer
from app.engine.vllm.upstreams import Failed, Upstream, UpstreamPool
from app.engine.vllm.wire import (
    STOCK_LOGPROB_ID_CAP,
    CanvasAnswer,
    ChunkCutter,
    UpstreamAnswerError,
    chat_read_body,
    collapse_images,
    completion_read_body,
    label_id_groups,
    merge_answers,
    parse_chat_read,
    parse_completion_read,
    read_results,
)

if TYPE_CHECKING:
    from app.engine.tokenizer import HFChatTokenizer

log = logging.getLogger("djev.engine")

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteOptions:
    """What the remote engine is told; built from Settings by `app.cli` (defaults live there)."""

    upstreams: tuple[str, ...]
    connect_timeout: float
    read_timeout: float
    health_interval: float
    max_prompt_tokens: int
    served_name: str
    canvas_length: int
    tiny: bool


class RemoteReader:
    stat_gauges = ("upstreams_healthy", "outstanding")  # levels, not counts (for /metrics)

    def __init__(self, tokenizer: HFChatTokenizer, image_ids: tuple[int, int, int],
                 info: ReaderInfo, options: RemoteOptions) -> None:
        self.tokenizer: ChatTokenizer = tokenizer
        self.info = info
        self.options = options
        self.pool = UpstreamPool(options.upstreams, connect_timeout=options.connect_timeout,
                                 read_timeout=options.read_timeout, health_interval=options.health_interval)
        self.upstreams = self.pool.upstreams
        self.image_id, self.boi_id, self.eoi_id = image_ids
        self.chat_former = ChatFormer(tokenizer, self.image_id)
        self.counts: Counter[str] = Counter()

    @property
    def ready(self) -> bool:
        return self.pool.ready

    @property
    def degraded(self) -> str | None:
        """Some upstreams down, some up: routed around, with less capacity (none up is not `ready`)."""
        return self.pool.degraded

    @property
    def upstream_states(self) -> list[UpstreamState]:
        """Each upstream's state and last error (UpstreamReport: `/health` lists them)."""
        return self.pool.states

    @property
    def stats(self) -> dict[str, float]:
        return {**self.counts, **self.pool.stats}

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    # ------------------------------------------------------------------ reads

    def _check_prompt(self, prompt: Prompt) -> None:
        if len(prompt.ids) > self.options.max_prompt_tokens:
            raise EngineInputError(
                f"the prompt is {len(prompt.ids)} tokens; this server reads at most {self.options.max_prompt_tokens}",
                status=400, param="state", error_type="max_tokens_exceeded")

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        for spec in specs:
            self._check_prompt(spec.prompt)
        # An image prompt's chat messages are formed (and checked) once, for all its canvases; every
        # image prompt's in one worker-thread trip.
        chats = await asyncio.to_thread(
            lambda: [self._form_chat(spec.prompt) if spec.prompt.images else None for spec in specs])
        jobs = []
        for spec, chat in zip(specs, chats):
            groups = label_id_groups(spec, STOCK_LOGPROB_ID_CAP)  # once, for all the spec's canvases
            jobs += [self._read_canvas(spec, canvas, groups, chat) for canvas in spec.canvases]
        results = read_results(specs, await gather_or_cancel(jobs))
        self.counts["reads"] += len(specs)
        return results

    def _form_chat(self, prompt: Prompt) -> dict[str, Any]:
        """An image prompt as chat completion fields: the prompt decoded, the template filled (rendered
        anew for a new shape) and every image base64-encoded, work that grows with the prompt and the
        images, so it runs in a worker thread (`_chat_fields`, `read`)."""
        return self.chat_former.form(prompt).request_fields(prompt.images)

    async def _chat_fields(self, prompt: Prompt) -> dict[str, Any]:
        return await asyncio.to_thread(self._form_chat, prompt)

    async def _read_canvas(self, spec: ReadSpec, canvas: tuple[int, ...], groups: Sequence[tuple[int, ...]],
                           chat: dict[str, Any] | None) -> CanvasAnswer:
        """One canvas, one request per group of label ids (`label_id_groups`), answers merged."""
        if chat is not None:
            fields = chat  # a dict: the narrowing of `chat` does not reach into the lambdas below
            parts = [self.pool.call(lambda u, ids=ids: self._chat_read(u, spec, canvas, ids, fields)) for ids in groups]
        else:
            parts = [self.pool.call(lambda u, ids=ids: self._completion_read(u, spec, canvas, ids)) for ids in groups]
        return merge_answers(await gather_or_cancel(parts))

    async def _completion_read(self, upstream: Upstream, spec: ReadSpec, canvas: tuple[int, ...],
                               ids: tuple[int, ...]) -> CanvasAnswer:
        return await self.pool.post_json(upstream, "/v1/completions", completion_read_body(spec, canvas, ids, None),
                                         lambda answer: self._parsed(upstream, parse_completion_read, answer))

    async def _chat_read(self, upstream: Upstream, spec: ReadSpec, canvas: tuple[int, ...],
                         ids: tuple[int, ...], chat: dict[str, Any]) -> CanvasAnswer:
        """One canvas read through `/v1/chat/completions` (`chat`: the prompt as messages)."""
        body = chat_read_body(spec, canvas, ids, chat)

        def parse(answer: Any) -> tuple[bool | None, CanvasAnswer]:  # maybe in a worker thread
            return self._rendered_as_ours(spec.prompt, answer), self._parsed(upstream, parse_chat_read, answer)

        ours, parsed = await self.pool.post_json(upstream, "/v1/chat/completions", body, parse)
        if ours is not None:
            self.counts["chat_prompts_checked"] += 1
        if ours is False:
            self.counts["chat_prompt_mismatches"] += 1
            log.warning("upstream %s rendered the chat prompt differently from djev's ids (a state with "
                        "special-token text?); the read went on with vLLM's rendering", upstream.url)
        return parsed

    def _rendered_as_ours(self, prompt: Prompt, answer: Any) -> bool | None:
        """Whether the prompt vLLM rendered from the messages is djev's own (images aside); None when
        the answer does not say."""
        rendered = answer.get("prompt_token_ids") if isinstance(answer, dict) else None
        if not isinstance(rendered, list):
            return None
        return collapse_images(rendered, self.image_id, self.boi_id, self.eoi_id) == list(prompt.ids)

    @staticmethod
    def _parsed(upstream: Upstream, parse: Callable[[Any], T], answer: Any) -> T:
        try:
            return parse(answer)
        except UpstreamAnswerError as exc:
            raise Failed(upstream, f"unusable answer: {exc}") from None

    # ------------------------------------------------------------------ generation

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await collect(self.stream(spec))

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        """vLLM's own block diffusion, streamed. vLLM refuses per-request seeds and temperatures for
        diffusion models, so `seed` is not sent (generation there is not reproducible per seed)."""
        self._check_prompt(spec.prompt)
        if spec.temperature != 1.0:
            raise EngineInputError("temperature: vLLM generates at the checkpoint's own temperature schedule only",
                                   status=400, param="temperature")
        body: dict[str, Any] = {"max_tokens": spec.max_tokens, "stream": True, "return_token_ids": True,
                                "stop_token_ids": list(spec.stop_ids)}
        if spec.top_p != 1.0:
            body["top_p"] = spec.top_p
        if spec.prompt.images:
            path = "/v1/chat/completions"
            body.update(await self._chat_fields(spec.prompt))
        else:
            path = "/v1/completions"
            body["prompt"] = list(spec.prompt.ids)
        cutter = ChunkCutter(spec)
        async for event in self._event_stream(path, body):
            choices = event.get("choices") or []
            if isinstance(event.get("prompt_token_ids"), list):
                cutter.prompt_tokens = len(event["prompt_token_ids"])
            for choice in choices:
                if isinstance(choice.get("prompt_token_ids"), list):
                    cutter.prompt_tokens = len(choice["prompt_token_ids"])
                reason = choice.get("finish_reason")
                chunk = cutter.chunk(choice.get("token_ids") or [], reason is not None, reason)
                yield chunk
                if chunk.done:
                    return
        yield cutter.end()

    async def _event_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Server-sent events of a streamed request. Only opening the stream is retried elsewhere: once
        tokens have come, a failure ends the generation with an EngineError."""
        response, upstream = await self.pool.call(lambda u: self.pool.open_stream(u, path, body))
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise EngineError(f"upstream {upstream.url}: a streamed event is not JSON: {data[:80]!r}") from None
                if isinstance(event, dict) and "error" in event:
                    raise EngineError(f"upstream {upstream.url}: {json.dumps(event['error'])[:200]}")
                if isinstance(event, dict):
                    yield event
        except httpx.HTTPError as exc:
            raise EngineError(f"upstream {upstream.url}: the stream broke ({describe(exc)})") from None
        finally:
            await self.pool.close_stream(response, upstream)

    # ------------------------------------------------------------------ raw chat

    async def relay_chat(self, body: dict) -> RelayedResponse:
        """The body to an upstream's `/v1/chat/completions` unchanged; its status and body back (vLLM's
        errors included), as chunks when the client asked for a stream."""
        path = "/v1/chat/completions"
        response, upstream = await self.pool.call(lambda u: self.pool.open_stream(u, path, body, any_status=True))
        if not body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                raise EngineError(f"upstream {upstream.url}: the answer broke off ({describe(exc)})") from None
            finally:
                await self.pool.close_stream(response, upstream)
            return RelayedResponse(status=response.status_code, body=content,
                                   media_type=response.headers.get("content-type", "application/json"))
        return RelayedResponse(status=response.status_code, chunks=self._relay_chunks(response, upstream),
                               media_type=response.headers.get("content-type", "text/event-stream"))

    async def _relay_chunks(self, response: httpx.Response, upstream: Upstream) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise EngineError(f"upstream {upstream.url}: the stream broke ({describe(exc)})") from None
        finally:
            await self.pool.close_stream(response, upstream)


def load_remote_reader(checkpoint: str | Path, options: RemoteOptions) -> RemoteReader:
    """The remote engine over a local checkpoint directory (for its tokenizer and config only)."""
    path = Path(checkpoint)
    config = CheckpointConfig.read(path)
    tokenizer, _ = load_tokenizer(path, config)
    device = ", ".join(url.rstrip("/") for url in options.upstreams)
    info = ReaderInfo(model=options.served_name or path.name, engine="remote", device=f"vLLM at {device}",
                      tiny=options.tiny, canvas_length=options.canvas_length, checkpoint=str(path))
    return RemoteReader(tokenizer, (config.image_id, config.boi_id, config.eoi_id), info, options)
