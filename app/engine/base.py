"""The contract between the decision logic and a model: what a read is, what comes back.

`app/decisions/` builds `ReadSpec`s and `GenerateSpec`s and hands them to a `Reader`; a reader
(`hf`, `vllm`, `remote`) executes them. Nothing here touches a model, so the decision logic can be
tested against a fake reader. Every reader keeps the scheduling contract of docs/design.md §2.2:
cancellation is the only deadline, bounded reordering, a generation yields after every denoise
pass, only `EngineInputError`, `EngineError` and `EngineUnavailable` leave a reader, and no request
holds the engine: an engine turn is bounded (a long prompt is encoded in chunks of PREFILL_CHUNK
tokens, a read of many canvases or steps runs one pass a turn), and work that needs more turns goes
back to the end of the queue after each, with the light reads waiting served before its next step,
so a steady client waits at most one step of one heavy request. A turn ends when its work is done,
not when it is queued: an engine that runs a device asynchronously waits for a step's device work
before the turn ends, or the steps' work piles up behind the host and the next short read waits it
out.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from PIL import Image

T = TypeVar("T")

# Who a read is for: one decision. The web layer sets it around each decision (`new_caller`), and the
# decision's group tasks inherit it; a reader may use it to share its batches fairly among callers
# (the hf engine does). 0: nobody said (tests, scripts), all one caller.
current_caller: ContextVar[int] = ContextVar("djev_current_caller", default=0)
_callers = itertools.count(1)


def new_caller() -> int:
    """A caller id no other decision of this process has."""
    return next(_callers)


# Told each start-up phase as it begins and as it goes: (phase, done, total), e.g.
# ("loading weights", 0, 1) or ("capturing graphs", 12, 40). `/health` shows the latest.
StartupProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ImageInput:
    """One encoded image (JPEG, PNG, ...) as the client sent it, plus where it came from."""

    data: bytes
    content_type: str
    source: str = "image"  # the multipart part name or "images[i]", for error messages

    @cached_property
    def digest(self) -> str:
        """Hashed once per image (up to MAX_IMAGE_BYTES of it), however many caches ask."""
        return hashlib.sha256(self.data).hexdigest()[:32]


# A prompt's key in the engines' caches: its ids and its images' digests (`ImageInput.digest`).
CacheKey = tuple[tuple[int, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Prompt:
    """Token ids of a rendered prompt.

    Each image appears in `ids` as exactly one `ChatTokenizer.image_placeholder_id`; the engine
    expands it into the model's begin-of-image, soft tokens and end-of-image after it has measured
    the image, so the decision logic never decodes an image.
    """

    ids: tuple[int, ...]
    images: tuple[ImageInput, ...] = ()

    @cached_property
    def cache_key(self) -> CacheKey:
        return (self.ids, tuple(image.digest for image in self.images))


def decode_images(prompt: Prompt) -> list[Image.Image]:
    """The prompt's images as RGB PIL images (blocking: call it off the event loop). A file that does
    not decode is the client's: a 422 naming where it came from."""
    import io

    from PIL import Image

    pictures: list[Image.Image] = []
    for image in prompt.images:
        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                pictures.append(opened.convert("RGB"))
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's image
            raise EngineInputError(f"{image.source}: not a decodable image ({exc})", status=422,
                                   param=image.source) from exc
    return pictures


def describe(exc: BaseException) -> str:
    """An exception in one line for an error message: its type, and its text when it has one."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def gather_or_cancel(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """Await every coroutine at once; if one fails or the caller is cancelled, cancel the rest and
    wait for them, so none outlives the call (a read's canvases in the vLLM engines, a decision's
    groups in the Decider: a refused group must not leave its siblings reading for nobody)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


@dataclass(frozen=True)
class ReadSpec:
    """One read-only read of a template-seeded canvas.

    Every canvas has the same width and differs from the others only at the slot positions (the
    noise draws). The engine runs `steps` denoise passes with every position except the slots
    pinned, and reports temperature-1 log-probabilities of each slot's label ids.
    """

    prompt: Prompt
    canvases: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    label_ids: tuple[tuple[int, ...], ...]  # one tuple per slot, same order as `slots`
    steps: int = 1
    seed: int = 0  # the engine's own noise (re-noising between steps when steps > 1)

    @property
    def width(self) -> int:
        return len(self.canvases[0])


@dataclass(frozen=True)
class SlotRead:
    """What one canvas says at one slot."""

    label_logprobs: tuple[float, ...]  # full-vocabulary log-probabilities of the slot's label ids
    argmax_id: int  # the most probable token over the whole vocabulary


@dataclass(frozen=True)
class ReadResult:
    slots: tuple[tuple[SlotRead, ...], ...]  # [canvas][slot]
    prompt_tokens: int  # the prompt as the model saw it, image soft tokens included


@dataclass(frozen=True)
class GenerateSpec:
    """Plain diffusion generation: up to `max_tokens` tokens after the prompt, cut at a stop id.

    `temperature` scales the checkpoint's temperature schedule (1.0 = as the checkpoint says; 0 =
    greedy: every position takes its most probable token); `top_p` keeps, at each sampled position,
    the smallest set of tokens whose probability reaches it (1.0 = all)."""

    prompt: Prompt
    max_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class GenerateResult:
    ids: tuple[int, ...]  # generated ids before any stop id
    stopped: bool  # True when a stop id ended the generation
    prompt_tokens: int
    passes: int = 0  # denoise passes the engine ran (0 where the engine does not say)


@dataclass(frozen=True)
class GenerateChunk:
    """What a streaming generation has committed since its previous chunk. The last chunk has
    `done` set, with `stopped` as in GenerateResult."""

    ids: tuple[int, ...]
    done: bool = False
    stopped: bool = False
    prompt_tokens: int = 0
    passes: int = 0


async def collect(chunks: AsyncIterator[GenerateChunk]) -> GenerateResult:
    """A whole GenerateResult from a stream of chunks (how a reader's `generate` may be written)."""
    ids: list[int] = []
    last = GenerateChunk(ids=(), done=True)
    async for chunk in chunks:
        ids.extend(chunk.ids)
        last = chunk
    return GenerateResult(ids=tuple(ids), stopped=last.stopped, prompt_tokens=last.prompt_tokens, passes=last.passes)


@dataclass(frozen=True)
class ReaderInfo:
    """What `/health`, the pages' header and the logs say about the model that answers."""

    model: str  # the served model name, echoed in every Jev response
    engine: str  # "hf", "vllm", "remote"
    device: str  # "cpu", "cuda", "NVIDIA H200", ...
    tiny: bool  # the tiny random-weight model: answers are random
    canvas_length: int
    checkpoint: str = ""
    max_prompt_tokens: int = 0  # the longest prompt this engine reads (0: not said)
    frame_rate: float = 0.0  # camera frames a second read at start-up, many at once (0: not measured)
    max_sessions: int = 0  # camera sessions the engine holds at once (0: not said; MAX_SESSIONS=0 follows it)


class EngineError(Exception):
    """The model failed to answer: a 502 for the client."""


class EngineUnavailable(EngineError):
    """The engine is not running (starting, stopped, or overloaded): a 503."""


class EngineInputError(Exception):
    """The input cannot be read by this model (a prompt past the context, a broken image): a 4xx.

    `status` is the HTTP status, `param` the request field at fault, `error_type` Jev's error type.
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type


class ChatTokenizer(Protocol):
    """The tokenizer as the decision logic needs it: plain text in, ids out, plus the chat format."""

    vocab_size: int  # noise ids are drawn uniformly from [0, vocab_size)
    pad_id: int
    turn_close_id: int  # `<turn|>`, which ends the answer on every canvas
    image_placeholder_id: int
    thought_open: tuple[int, ...]  # `<|channel>thought\n`
    thought_close: tuple[int, ...]  # `<channel|>`

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in the text stay plain text."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, system: str, user: str, images: int, thinking: bool) -> list[int]:
        """The chat prompt up to the model's turn, as the checkpoint's chat template renders it.

        The user turn holds `images` image placeholders ahead of the `user` text. With `thinking`
        off, the template ends with the empty thought block; with it on, it leaves the model's turn
        open for a thought.
        """
        ...

    def render_messages(self, messages: Sequence[tuple[str, str]], images: int, thinking: bool) -> list[int]:
        """A whole conversation of (role, text) messages, the same way (images before the first
        user text)."""
        ...


@dataclass(frozen=True)
class RelayedResponse:
    """An upstream's answer to a relayed request: the whole body, or its chunks as they come
    (server-sent events when the client asked for `stream`)."""

    status: int
    media_type: str
    body: bytes = b""
    chunks: AsyncIterator[bytes] | None = None


@runtime_checkable
class ChatRelay(Protocol):
    """A reader backed by a vLLM OpenAI server (in process or remote) relays raw chat completions to
    it unchanged; the raw route checks for this capability and otherwise generates itself."""

    async def relay_chat(self, body: dict) -> RelayedResponse: ...


@dataclass(frozen=True)
class UpstreamState:
    """One server a reader serves through (the remote engine's vLLM servers), as `/health` lists it."""

    url: str
    up: bool
    last_error: str | None  # why it is down, without its URL (that is `url`); None while it is up

    def as_json(self) -> dict:
        return {"url": self.url, "state": "up" if self.up else "down", "last_error": self.last_error}


@runtime_checkable
class UpstreamReport(Protocol):
    """A reader that serves through upstream servers says how each stands: `/health` lists them, is
    `degraded` while some are down and `unavailable` with `upstreams_unavailable` once all are."""

    @property
    def upstream_states(self) -> Sequence[UpstreamState]: ...


def _named_once(states: Sequence[UpstreamState]) -> str:
    return "; ".join(f"{state.url} ({state.last_error or 'down'})" for state in states)


def upstreams_degraded(states: Sequence[UpstreamState]) -> str | None:
    """Why a reader with some upstreams down (and some up) is degraded, each down one named once
    with its error; None while all are up or none is (then it is not ready at all)."""
    down = [state for state in states if not state.up]
    if not down or len(down) == len(states):
        return None
    return f"{len(down)} of {len(states)} upstreams down: {_named_once(down)}"


def upstreams_unavailable(states: Sequence[UpstreamState]) -> str:
    """What a request is told, and `/health` says, when no upstream is up: each named once with its error."""
    return f"no upstream available: {_named_once(states)}"


class Reader(Protocol):
    @property
    def info(self) -> ReaderInfo: ...

    @property
    def tokenizer(self) -> ChatTokenizer: ...

    @property
    def ready(self) -> bool:
        """True while the reader accepts work (`/health` says unavailable otherwise)."""
        ...

    @property
    def degraded(self) -> str | None:
        """None normally; why, when the engine had to degrade (it still serves, slower or with less):
        `/health` then says "degraded" with this reason."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        """Run the reads; results come back in the order of `specs`."""
        ...

    async def generate(self, spec: GenerateSpec) -> GenerateResult: ...

    def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        """The same generation, chunk by chunk as the engine commits tokens."""
        ...

    @property
    def stats(self) -> Mapping[str, float]:
        """Engine-specific counters and gauges (`/metrics` exports them as djev_<engine>_<name>):
        e.g. the hf engine's encoder and decoder passes and prompt-cache hits, its queue depth."""
        ...
