"""The contract between the decision logic and a model: what a read is, what comes back.

`app/decisions/` builds `ReadSpec`s and `GenerateSpec`s and hands them to a `Reader`; a reader
(`hf`, `vllm`, `remote`) executes them. Nothing here touches a model, so the decision logic can be
tested against a fake reader.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class ImageInput:
    """One encoded image (JPEG, PNG, ...) as the client sent it, plus where it came from."""

    data: bytes
    content_type: str
    source: str = "image"  # the multipart part name or "images[i]", for error messages

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()[:32]


@dataclass(frozen=True)
class Prompt:
    """Token ids of a rendered prompt.

    Each image appears in `ids` as exactly one `ChatTokenizer.image_placeholder_id`; the engine
    expands it into the model's begin-of-image, soft tokens and end-of-image after it has measured
    the image, so the decision logic never decodes an image.
    """

    ids: tuple[int, ...]
    images: tuple[ImageInput, ...] = ()

    @property
    def cache_key(self) -> tuple:
        return (self.ids, tuple(image.digest for image in self.images))


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
    """Plain diffusion generation: up to `max_tokens` tokens after the prompt, cut at a stop id."""

    prompt: Prompt
    max_tokens: int
    stop_ids: tuple[int, ...]
    seed: int


@dataclass(frozen=True)
class GenerateResult:
    ids: tuple[int, ...]  # generated ids before any stop id
    stopped: bool  # True when a stop id ended the generation
    prompt_tokens: int


@dataclass(frozen=True)
class ReaderInfo:
    """What `/health`, the pages' header and the logs say about the model that answers."""

    model: str  # the served model name, echoed in every Jev response
    engine: str  # "hf", "vllm", "remote"
    device: str  # "cpu", "cuda", "NVIDIA H200", ...
    tiny: bool  # the tiny random-weight model: answers are random
    canvas_length: int
    checkpoint: str = ""
    details: dict = field(default_factory=dict)


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


class Reader(Protocol):
    info: ReaderInfo
    tokenizer: ChatTokenizer

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        """Run the reads; results come back in the order of `specs`."""
        ...

    async def generate(self, spec: GenerateSpec) -> GenerateResult: ...
