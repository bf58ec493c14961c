"""What the `vllm` and `remote` engines share: how a djev read becomes vLLM requests, how vLLM's
logprobs become `SlotRead`s, and how vLLM's generated pieces become `GenerateChunk`s (what they read
of the checkpoint itself is app/engine/vllm/checkpoint.py).

A read is one vLLM request per canvas, the canvas fields in `extra_args` (`vllm_xargs` over HTTP)
and the label ids in `logprob_token_ids`, split into requests of at most `cap` ids where a read has
more, their answers merged. The fields and why: docs/design.md §4.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from app.engine.base import EngineError, GenerateChunk, GenerateSpec, ReadResult, ReadSpec, SlotRead

# Stock vLLM's cap on `logprob_token_ids` per request (vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS).
STOCK_LOGPROB_ID_CAP = 128


class UpstreamAnswerError(EngineError):
    """vLLM answered, but not with what a read needs (a missing position, a missing label id)."""


def label_id_groups(spec: ReadSpec, cap: int) -> list[tuple[int, ...]]:
    """The distinct label ids of a read, sorted, in groups of at most `cap` (one request each)."""
    ids = sorted({token for labels in spec.label_ids for token in labels})
    return [tuple(ids[start:start + cap]) for start in range(0, len(ids), cap)]


def read_extra_args(spec: ReadSpec, canvas: Sequence[int]) -> dict[str, Any]:
    """The diffusion fields of one canvas's request."""
    width = len(canvas)
    args: dict[str, Any] = {
        "diffusion_seed_canvas": list(canvas),
        "diffusion_canvas_length": width,
        "diffusion_max_steps": spec.steps,
        "diffusion_read_only": True,
    }
    if spec.steps > 1:
        slots = set(spec.slots)
        args["diffusion_pinned"] = [position for position in range(width) if position not in slots]
    return args


def completion_read_body(spec: ReadSpec, canvas: Sequence[int], ids: Sequence[int], model: str | None) -> dict:
    """`POST /v1/completions` for one canvas and one group of label ids."""
    body: dict[str, Any] = {
        "prompt": list(spec.prompt.ids),
        "max_tokens": len(canvas),
        "logprob_token_ids": list(ids),
        "logprobs": len(ids),
        "return_tokens_as_token_ids": True,
        "vllm_xargs": read_extra_args(spec, canvas),
    }
    if model:
        body["model"] = model
    return body


def chat_read_body(spec: ReadSpec, canvas: Sequence[int], ids: Sequence[int], chat: Mapping[str, Any]) -> dict:
    """`POST /v1/chat/completions` for one canvas and one group of label ids, `chat` holding the
    prompt as messages and the template switches (`ChatForm.request_fields`). vLLM answers with the
    prompt ids it rendered (`return_token_ids`), for the caller to check against djev's."""
    return {
        **chat,
        "max_tokens": len(canvas),
        "logprobs": True,
        "top_logprobs": len(ids),
        "logprob_token_ids": list(ids),
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "vllm_xargs": read_extra_args(spec, canvas),
    }


@dataclass(frozen=True)
class CanvasAnswer:
    """What vLLM said about one canvas: per position, id -> logprob; the argmax id per position."""

    logprobs: list[dict[int, float]]
    argmax_ids: list[int]
    prompt_tokens: int


def _token_id(token: Any, where: str) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            pass
    raise UpstreamAnswerError(f"{where}: expected a token as 'token_id:<id>', got {str(token)[:40]!r}")


def _logprob(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UpstreamAnswerError(f"{where}: expected a number, got {str(value)[:40]!r}")
    return float(value)


def _prompt_tokens(answer: Mapping[str, Any]) -> int:
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return int(usage["prompt_tokens"])
    raise UpstreamAnswerError("the answer has no usage.prompt_tokens")


def _first_choice(answer: Any) -> Mapping[str, Any]:
    if not isinstance(answer, dict):
        raise UpstreamAnswerError("the answer is not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamAnswerError("the answer has no choices")
    logprobs = choices[0].get("logprobs")
    if not isinstance(logprobs, dict):
        raise UpstreamAnswerError("the answer has no logprobs")
    return logprobs


def parse_completion_read(answer: Any) -> CanvasAnswer:
    """A `/v1/completions` answer: `logprobs.tokens[i]` is position i's argmax, `top_logprobs[i]`
    maps 'token_id:<id>' to its logprob."""
    logprobs = _first_choice(answer)
    tokens, tops = logprobs.get("tokens"), logprobs.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops):
        raise UpstreamAnswerError("logprobs.tokens and logprobs.top_logprobs are missing or differ in length")
    maps: list[dict[int, float]] = []
    for position, top in enumerate(tops):
        where = f"position {position}"
        if not isinstance(top, dict):
            raise UpstreamAnswerError(f"{where}: top_logprobs is not an object")
        maps.append({_token_id(key, where): _logprob(value, where) for key, value in top.items()})
    argmax = [_token_id(token, f"position {i}") for i, token in enumerate(tokens)]
    return CanvasAnswer(maps, argmax, _prompt_tokens(answer))


def parse_chat_read(answer: Any) -> CanvasAnswer:
    """A `/v1/chat/completions` answer: `logprobs.content[i]` holds position i's argmax `token` and
    its `top_logprobs` as a list of {token, logprob}."""
    content = _first_choice(answer).get("content")
    if not isinstance(content, list):
        raise UpstreamAnswerError("logprobs.content is missing")
    maps: list[dict[int, float]] = []
    argmax: list[int] = []
    for position, entry in enumerate(content):
        where = f"position {position}"
        if not isinstance(entry, dict) or not isinstance(entry.get("top_logprobs"), list):
            raise UpstreamAnswerError(f"{where}: no top_logprobs")
        argmax.append(_token_id(entry.get("token"), where))
        found: dict[int, float] = {}
        for item in entry["top_logprobs"]:
            if not isinstance(item, dict):
                raise UpstreamAnswerError(f"{where}: a top_logprobs entry is not an object")
            found[_token_id(item.get("token"), where)] = _logprob(item.get("logprob"), where)
        maps.append(found)
    return CanvasAnswer(maps, argmax, _prompt_tokens(answer))


def merge_answers(parts: Sequence[CanvasAnswer]) -> CanvasAnswer:
    """The answers of one canvas's split requests as one (each part holds some of the label ids)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    maps = [dict(position) for position in first.logprobs]
    for part in parts[1:]:
        for position, found in zip(maps, part.logprobs):
            position.update(found)
    return CanvasAnswer(maps, first.argmax_ids, first.prompt_tokens)


def slot_reads(spec: ReadSpec, answer: CanvasAnswer) -> tuple[SlotRead, ...]:
    """Each slot's label logprobs and argmax from one canvas's answer."""
    reads = []
    for slot, labels in zip(spec.slots, spec.label_ids):
        if slot >= len(answer.logprobs) or slot >= len(answer.argmax_ids):
            raise UpstreamAnswerError(
                f"the answer covers {len(answer.logprobs)} canvas positions; slot {slot} is past them")
        found = answer.logprobs[slot]
        missing = [token for token in labels if token not in found]
        if missing:
            raise UpstreamAnswerError(f"position {slot}: no logprob for label ids {missing[:8]}")
        values = tuple(found[token] for token in labels)
        if not all(math.isfinite(value) or value == -math.inf for value in values):
            raise UpstreamAnswerError(f"position {slot}: a label logprob is not a number")
        reads.append(SlotRead(label_logprobs=values, argmax_id=answer.argmax_ids[slot]))
    return tuple(reads)


def read_result(spec: ReadSpec, answers: Sequence[CanvasAnswer]) -> ReadResult:
    """The ReadResult of a spec from its canvases' answers (in canvas order)."""
    return ReadResult(
        slots=tuple(slot_reads(spec, answer) for answer in answers),
        prompt_tokens=answers[0].prompt_tokens if answers else 0,
    )


def read_results(specs: Sequence[ReadSpec], answers: Sequence[CanvasAnswer]) -> list[ReadResult]:
    """Each spec's ReadResult from the answers of all the specs' canvases, in spec then canvas order
    (how both engines submit a call to `read()`)."""
    results, offset = [], 0
    for spec in specs:
        results.append(read_result(spec, answers[offset:offset + len(spec.canvases)]))
        offset += len(spec.canvases)
    return results


class ChunkCutter:
    """Turns what vLLM generated since its last report into djev's GenerateChunks, for one
    generation: a piece is cut at its first stop id (the stop id itself is never returned), the
    total is held to `max_tokens`, and a stop id or vLLM's finish ends the stream."""

    def __init__(self, spec: GenerateSpec) -> None:
        self.stops = frozenset(spec.stop_ids)
        self.max_tokens = spec.max_tokens
        self.produced = 0
        self.prompt_tokens = len(spec.prompt.ids)  # the engine replaces it by what vLLM reports

    def chunk(self, token_ids: Iterable[int], finished: bool, finish_reason: str | None) -> GenerateChunk:
        """The chunk for one piece; `done` once a stop id came or vLLM said the request finished."""
        ids = [int(token) for token in token_ids]
        cut = next((index for index, token in enumerate(ids) if token in self.stops), None)
        ids = (ids if cut is None else ids[:cut])[:self.max_tokens - self.produced]
        self.produced += len(ids)
        return GenerateChunk(ids=tuple(ids), done=cut is not None or finished,
                             stopped=cut is not None or finish_reason == "stop", prompt_tokens=self.prompt_tokens)

    def end(self) -> GenerateChunk:
        """The closing chunk of a stream vLLM ended without saying it finished."""
        return GenerateChunk(ids=(), done=True, stopped=False, prompt_tokens=self.prompt_tokens)


def collapse_images(ids: Sequence[int], image_id: int, boi_id: int, eoi_id: int) -> list[int]:
    """Prompt ids as vLLM expanded them (begin-of-image, soft tokens, end-of-image per image) with
    each image back to djev's single placeholder, to compare with djev's own prompt ids."""
    out: list[int] = []
    inside = False
    for token in ids:
        if token == boi_id:
            inside = True
            out.append(image_id)
        elif inside:
            if token == eoi_id:
                inside = False
        else:
            out.append(token)
    return out
