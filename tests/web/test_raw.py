"""Raw generation (`/v1/raw/chat/completions`): every OpenAI field honoured or refused with a 400
naming it, `stop` cut, `stream` as OpenAI's server-sent chunks, relaying readers get the body
unchanged, and the deadline holds."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from app.config import Settings
from app.engine.base import EngineUnavailable, GenerateChunk, GenerateResult, RelayedResponse
from app.server import create_app
from app.web.raw_request import StopCutter, cut_at_stop
from tests.fakes import PROMPT_TOKENS, ScriptedReader

TEXT = "Red, green and blue. STOP here. Then more words follow."
ASK = {"messages": [{"role": "user", "content": "Name three primary colors."}]}


class Writer(ScriptedReader):
    """Generates TEXT, a few ids per chunk; records every spec and whether a stream was closed early."""

    def __init__(self, tokenizer, delay: float = 0.0, fail: Exception | None = None) -> None:
        super().__init__(tokenizer)
        self.ids = tuple(tokenizer.encode(TEXT))
        self.delay = delay
        self.fail = fail
        self.specs: list = []
        self.streams_closed_early = 0
        self.cancelled = 0

    async def generate(self, spec):
        self.specs.append(spec)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = self.ids[: spec.max_tokens]
        return GenerateResult(ids=ids, stopped=len(self.ids) <= spec.max_tokens, prompt_tokens=PROMPT_TOKENS)

    async def stream(self, spec):
        self.specs.append(spec)
        if self.fail is not None:
            raise self.fail
        ids = self.ids[: spec.max_tokens]
        finished = False
        try:
            for start in range(0, len(ids), 3):
                await asyncio.sleep(self.delay)
                yield GenerateChunk(ids=ids[start:start + 3])
            finished = True
            yield GenerateChunk(ids=(), done=True, stopped=len(self.ids) <= spec.max_tokens,
                                prompt_tokens=PROMPT_TOKENS)
        finally:
            if not finished:
                self.streams_closed_early += 1


@pytest.fixture
def writer(tokenizer):
    reader = Writer(tokenizer)
    with TestClient(create_app(Settings.of(default_seed=7), reader)) as client:
        client.reader = reader
        yield client


def post(client, **fields):
    return client.post("/v1/raw/chat/completions", json={**ASK, **fields})


def events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_honoured_fields_reach_the_sampler(writer):
    response = post(writer, temperature=0.5, top_p=0.9, seed=11, max_tokens=64, model="my-model", user="u-1", n=1,
                    presence_penalty=0, frequency_penalty=0.0, logprobs=False, tools=None)
    assert response.status_code == 200, response.text
    (spec,) = writer.reader.specs
    assert (spec.temperature, spec.top_p, spec.seed, spec.max_tokens) == (0.5, 0.9, 11, 64)
    assert spec.stop_ids == (writer.reader.tokenizer.turn_close_id,)
    body = response.json()
    assert body["model"] == "my-model" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == TEXT and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(writer.reader.ids),
                             "total_tokens": PROMPT_TOKENS + len(writer.reader.ids)}


def test_defaults_come_from_settings(writer):
    assert post(writer).status_code == 200
    assert post(writer, max_completion_tokens=5).status_code == 200
    default, limited = writer.reader.specs
    assert default.seed == 7 and default.max_tokens == 256 and (default.temperature, default.top_p) == (1.0, 1.0)
    assert limited.max_tokens == 5
    assert post(writer, max_completion_tokens=5).json()["choices"][0]["finish_reason"] == "length"


def test_stop_cuts_the_text_at_the_first_stop_string(writer):
    body = post(writer, stop=["never", " STOP"]).json()
    assert body["choices"][0]["message"]["content"] == "Red, green and blue."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert post(writer, stop="green").json()["choices"][0]["message"]["content"] == "Red, "


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"functions": []}, "functions"),
    ({"x_trace": "abc"}, "x_trace"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options.chunk_size"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.0.name"),
])
def test_unsupported_fields_are_400_naming_them(writer, fields, param):
    response = post(writer, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["message"].startswith(param)
    assert not writer.reader.specs


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"seed": "1"}, "seed"),
    ({"model": 3}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
])
def test_bad_values_are_422_naming_the_field(writer, fields, param):
    response = post(writer, **fields)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"]["param"] == param and body["detail"][0]["loc"] == ["body", *param.split(".")]


def test_a_body_that_is_not_json_is_422_json_invalid(writer):
    response = writer.post("/v1/raw/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"


def test_stream_sends_openai_chunks(writer):
    response = post(writer, stream=True, model="m", stream_options={"include_usage": True})
    assert response.status_code == 200
    chunks = events(response)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == TEXT
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3  # piece by piece
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(writer.reader.ids)
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_stops_at_a_stop_string_and_drops_the_rest_of_the_generation(writer):
    chunks = events(post(writer, stream=True, stop="STOP"))
    assert "usage" not in chunks[0]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Red, green and blue. "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert writer.reader.streams_closed_early == 1


def test_stream_that_fails_at_once_is_an_ordinary_error_response(tokenizer):
    reader = Writer(tokenizer, fail=EngineUnavailable("stopped"))
    with TestClient(create_app(Settings(), reader)) as client:
        response = post(client, stream=True)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert client.get("/health").json()["in_flight"] == 0


def test_generation_past_request_timeout_is_504_and_cancelled(tokenizer):
    reader = Writer(tokenizer, delay=30)
    with TestClient(create_app(Settings.of(request_timeout=0.3), reader)) as client:
        response = post(client)
        assert response.status_code == 504 and reader.cancelled == 1
        streamed = post(client, stream=True)  # the first chunk never comes: a plain 504
        assert streamed.status_code == 504
        assert client.get("/health").json()["in_flight"] == 0


def test_a_generation_costing_more_than_the_budget_is_400_naming_max_tokens(tokenizer):
    with TestClient(create_app(Settings.of(max_inflight_cost=100), Writer(tokenizer))) as client:
        response = post(client, max_tokens=200)
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


class Relay(ScriptedReader):
    """A reader backed by an OpenAI server: it relays raw chat bodies."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.bodies: list = []

    async def relay_chat(self, body):
        self.bodies.append(body)
        if body.get("stream"):
            async def chunks():
                yield b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
                yield b"data: [DONE]\n\n"
            return RelayedResponse(status=200, media_type="text/event-stream", chunks=chunks())
        return RelayedResponse(status=400, media_type="application/json", body=b'{"error": "upstream says no"}')


def test_a_relaying_reader_gets_the_body_unchanged(tokenizer):
    reader = Relay(tokenizer)
    with TestClient(create_app(Settings(), reader)) as client:
        body = {**ASK, "tools": [{"type": "function"}], "logprobs": True, "whatever": 1}
        response = client.post("/v1/raw/chat/completions", json=body)
        assert response.status_code == 400 and response.json() == {"error": "upstream says no"}
        streamed = client.post("/v1/raw/chat/completions", json={**ASK, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n") and "hi" in streamed.text
    assert reader.bodies == [body, {**ASK, "stream": True}]


def test_stop_cutter_holds_back_a_possible_stop_string():
    cutter = StopCutter(("<end>",))
    assert cutter.feed("abc<e") == "abc"
    assert cutter.feed("x") == "<ex"
    assert cutter.feed("yy<en") == "yy"
    assert cutter.feed("d>zz") == "" and cutter.stopped
    assert cutter.finish() == ""
    open_end = StopCutter(("</s>",))
    assert open_end.feed("tail </") == "tail " and open_end.finish() == "</"
    assert StopCutter(()).feed("anything") == "anything"
    assert cut_at_stop("one. two. three", (". t", "x")) == ("one", True)
    assert cut_at_stop("plain", ()) == ("plain", False)


def test_streaming_on_the_tiny_model_matches_the_whole_reply(tiny_reader):
    with TestClient(create_app(Settings(), tiny_reader)) as client:
        # Greedy: a sampled reply of the flat turn is the same only to rounding (its second read takes
        # the prompt from the KV store, in a turn of another shape), which sampling can turn into
        # another token; the stream's framing is what is checked here.
        whole = post(client, max_tokens=12, seed=3, temperature=0.0).json()
        response = post(client, max_tokens=12, seed=3, temperature=0.0, stream=True,
                        stream_options={"include_usage": True})
        assert response.status_code == 200, response.text
        chunks = events(response)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["usage"] == whole["usage"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == [whole["choices"][0]["finish_reason"]]
        assert client.get("/health").json()["in_flight"] == 0


def test_a_stream_that_fails_midway_ends_with_an_error_event(tokenizer):
    from app.engine.base import EngineError

    class Breaks(Writer):
        async def stream(self, spec):
            yield GenerateChunk(ids=self.ids[:3])
            raise EngineError("the model fell over")

    reader = Breaks(tokenizer)
    with TestClient(create_app(Settings(), reader)) as client:
        response = post(client, stream=True)
        assert response.status_code == 200
        lines = [line for line in response.text.split("\n") if line]
        assert "data: [DONE]" not in lines
        last = json.loads(lines[-1][6:])
        assert last["status"] == 502 and last["error"]["type"] == "upstream_error"
        assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
        assert client.get("/health").json()["in_flight"] == 0
