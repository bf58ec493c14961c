"""The body of `POST /v1/raw/chat/completions`, read field by field.

Every OpenAI chat-completions field is either honoured or refused with a 400 naming it; none is
silently dropped. A field sent as `null` counts as not sent (OpenAI's own reading). A value of the
wrong type or range for an honoured field is a 422 naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.decisions.chat import message_text
from app.web.errors import HTTPError

RAW_DEFAULT_MAX_TOKENS = 256
RAW_MAX_TOKENS = 4096
MAX_STOPS = 4
RAW_ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = ("role", "content")

HONOURED = ("messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
            "stream_options", "seed", "n", "user", "logprobs", "presence_penalty", "frequency_penalty")
# Known OpenAI fields this server cannot honour, with why (the 400 says it).
REFUSED = {
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "parallel_tool_calls": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "response_format": "structured output is /v1/systemone's job; raw generation writes free text",
    "logit_bias": "logit bias is not supported",
    "top_logprobs": "log-probabilities are not returned",
}


@dataclass(frozen=True)
class RawRequest:
    messages: tuple[tuple[str, str], ...]
    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed: int


def _invalid(key: str, message: str) -> HTTPError:
    return HTTPError(422, f"{key}: {message}", param=key, loc=tuple(key.split(".")))


def _refused(key: str, why: str) -> HTTPError:
    return HTTPError(400, f"{key}: {why}", param=key)


def _int(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(key, f"must be an integer from {low} to {high}")
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or not value <= high:
        interval = f"{'more than' if low_open else 'from'} {low:g} {'and at most' if low_open else 'to'} {high:g}"
        raise _invalid(key, f"must be a number {interval}")
    return float(value)


def _messages(raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "needs a non-empty list of {role, content}")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in RAW_ROLES:
            raise _invalid(f"messages.{index}.role", f"role must be one of {', '.join(RAW_ROLES)}")
        extra = next((key for key in message if key not in MESSAGE_KEYS), None)
        if extra is not None:
            raise _refused(f"messages.{index}.{extra}", "raw generation reads only role and content")
        content = message.get("content")
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise _invalid(f"messages.{index}.content", "raw generation takes text only")
        if not isinstance(content, (str, list)):
            raise _invalid(f"messages.{index}.content", "content must be a string or text parts")
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append((role, message_text(content)))
    return tuple(messages)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS \
            or not all(isinstance(s, str) and s for s in stops):
        raise _invalid("stop", f"must be a non-empty string or a list of 1 to {MAX_STOPS} non-empty strings")
    return tuple(stops)


def parse_raw(body: Any, default_seed: int) -> RawRequest:
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object with messages")
    sent = {key: value for key, value in body.items() if value is not None}
    for key in sent:
        if key in REFUSED:
            raise _refused(key, REFUSED[key])
        if key not in HONOURED:
            raise _refused(key, "unknown field; raw generation reads " + ", ".join(HONOURED))
    if sent.get("logprobs", False) is not False:
        raise _refused("logprobs", "log-probabilities are not returned")
    for key in ("presence_penalty", "frequency_penalty"):
        if sent.get(key, 0) != 0:
            raise _refused(key, "penalties are not supported (only 0)")
    if _int(sent, "n", 1, 1_000_000) not in (None, 1):
        raise _refused("n", "one choice per request (n: 1)")
    if not isinstance(sent.get("model", ""), str):
        raise _invalid("model", "must be a string")
    if not isinstance(sent.get("user", ""), str):
        raise _invalid("user", "must be a string")
    if not isinstance(sent.get("stream", False), bool):
        raise _invalid("stream", "must be true or false")
    stream = sent.get("stream", False)
    include_usage = False
    if "stream_options" in sent:
        options = sent["stream_options"]
        if not stream:
            raise _refused("stream_options", "only with stream: true")
        if not isinstance(options, dict):
            raise _invalid("stream_options", "must be an object")
        for key, value in options.items():
            if key != "include_usage":
                raise _refused(f"stream_options.{key}", "unknown option (include_usage is read)")
            if not isinstance(value, bool):
                raise _invalid("stream_options.include_usage", "must be true or false")
        include_usage = options.get("include_usage", False)
    max_tokens = _int(sent, "max_tokens", 1, RAW_MAX_TOKENS)
    max_completion = _int(sent, "max_completion_tokens", 1, RAW_MAX_TOKENS)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _invalid("max_completion_tokens", "differs from max_tokens; send one of them")
    seed = _int(sent, "seed", -(2**63) + 1, 2**63 - 1)
    return RawRequest(
        messages=_messages(body.get("messages")),
        model=sent.get("model"),
        max_tokens=max_completion or max_tokens or RAW_DEFAULT_MAX_TOKENS,
        temperature=_number(sent, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(sent, "top_p", 1.0, 0.0, 1.0, low_open=True),
        stop=_stop(sent.get("stop")),
        stream=stream,
        include_usage=include_usage,
        seed=default_seed if seed is None else seed,
    )


class StopCutter:
    """Cuts streamed text at the first stop string. Text that might be the start of a stop string
    is held back until the next piece shows whether it is."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> str:
        """The part of `text` (after what is held) that is safe to send now."""
        if self.stopped:
            return ""
        text = self.held + text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = self.hold if self.stops else 0
        safe = max(0, len(text) - keep)
        # Hold back only a tail that is a prefix of some stop string.
        while safe < len(text) and not any(s.startswith(text[safe:]) for s in self.stops):
            safe += 1
        self.held = text[safe:]
        return text[:safe]

    def finish(self) -> str:
        """What is still held when the generation ends."""
        held, self.held = self.held, ""
        return "" if self.stopped else held


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cutter = StopCutter(stops)
    out = cutter.feed(text)
    return out + cutter.finish(), cutter.stopped
