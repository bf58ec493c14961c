"""The reference's chat form (docs/wire.md §8; docs/behavior.md §8: T1, T13, T19) and raw generation
(docs/wire.md §9), over HTTP."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from tests.fakes import PROMPT_TOKENS, ScriptedReader

SCHEMA = {
    "questions": [
        {"id": "urgent", "type": "bool", "instructions": "Does the customer need a reply within the hour?",
         "criteria": {"true": "needs a reply now", "false": "can wait"}},
        {"id": "bucket", "type": "choice", "instructions": "Which team owns this?",
         "options": [{"name": "billing"}, {"name": "outage", "description": "service down"}, "feature"]},
        {"id": "tone", "type": "score", "instructions": "How angry is the customer?", "levels": ["calm", "annoyed", "furious"]},
    ],
    "samples": 3,
}
STATE = {"ticket": "Everything is down and we have a demo at noon."}


def chat(schema=SCHEMA, state=STATE, **extra):
    return {"model": "my-model", "messages": [
        {"role": "system", "content": json.dumps(schema)},
        {"role": "user", "content": json.dumps(state) if not isinstance(state, list) else state},
    ], **extra}


@pytest.fixture
def fake(tokenizer):
    reader = ScriptedReader(tokenizer)
    with TestClient(create_app(Settings(), reader)) as client:
        client.reader = reader
        yield client


def test_t1_the_chat_form_answers_in_the_reference_shape(fake):
    response = fake.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "my-model" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["role"] == "assistant"
    content = json.loads(body["choices"][0]["message"]["content"])
    urgent, bucket, tone = (content["answers"][q] for q in ("urgent", "bucket", "tone"))
    assert urgent["label"] == "yes" and urgent["noul"] == pytest.approx(0.7) and urgent["type"] == "noul"
    assert urgent["stderr"] < 1e-9 and urgent["agreement"] == 1.0
    assert bucket["choice"] == "billing" and list(bucket["probabilities"]) == ["billing", "outage", "feature"]
    assert tone["level"] == "calm" and tone["score"] == pytest.approx(1 * 0.7 + 2 * 0.15 + 3 * 0.15)
    assert content["diagnostics"]["samples"]["n"] == 3 and content["diagnostics"]["thought"] is None
    (spec,) = fake.reader.reads
    assert len(set(spec.canvases)) == 3
    rows = list(spec.canvases[0]).index(fake.reader.tokenizer.turn_close_id) + 1
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": rows, "total_tokens": PROMPT_TOKENS + rows}
    prompt = fake.reader.tokenizer.decode(spec.prompt.ids)
    assert json.dumps(STATE) in prompt and "outage (service down)" in prompt


def test_the_chat_form_takes_image_parts(fake):
    import base64

    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    state = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "a photo"}]
    response = fake.post("/v1/chat/completions", json=chat(state=state, schema={**SCHEMA, "samples": 1}))
    assert response.status_code == 200, response.text
    assert fake.reader.reads[0].prompt.images[0].data == _png()


@pytest.mark.parametrize("make, message", [
    (lambda: {"messages": [{"role": "system", "content": json.dumps(SCHEMA)}]}, "exactly two messages"),
    (lambda: {"messages": [{"role": "user", "content": "{}"}, {"role": "user", "content": "{}"}]}, "exactly two messages"),
    (lambda: {**chat(), "messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": "{}"}]},
     "JSON question schema"),
    (lambda: {**chat(), "messages": [{"role": "system", "content": json.dumps(SCHEMA)}, {"role": "user", "content": "not json"}]},
     "JSON question schema"),
    (lambda: chat(schema={"questions": [{"id": "x", "type": "choice", "options": ["only"]}]}), "at least two"),
    (lambda: chat(schema={"questions": [{"id": "x", "type": "noul"}, {"id": "x", "type": "noul"}]}), "duplicate question id 'x'"),
    (lambda: chat(schema={"questions": [{"id": "x", "type": "choice", "options": ["a", "a"]}]}), "duplicate option 'a'"),
    (lambda: chat(schema={**SCHEMA, "think": "lots"}), "think must be"),
    (lambda: chat(schema={"questions": []}), "non-empty questions array"),
])
def test_t19_chat_form_refusals_are_400(fake, make, message):
    response = fake.post("/v1/chat/completions", json=make())
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"{oops", b"", b'{"messages": NaN}'])
def test_the_chat_form_answers_a_body_that_is_not_json_with_400(fake, raw):
    response = fake.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["error"]["param"] == "body" and body["detail"]["error_type"] == "invalid_request_error"
    assert not fake.reader.reads


def test_the_chat_form_runs_under_request_timeout(tokenizer):
    import asyncio

    class Slow(ScriptedReader):
        async def read(self, specs):
            await asyncio.sleep(30)

    with TestClient(create_app(Settings.of(request_timeout=0.3), Slow(tokenizer))) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout_error"
        assert client.get("/health").json()["in_flight"] == 0


def test_t13_raw_generation_and_the_api_key(tiny_reader):
    with TestClient(create_app(Settings.of(api_key="s3cret"), tiny_reader)) as client:
        body = {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 8}
        assert client.post("/v1/raw/chat/completions", json=body).status_code == 403
        response = client.post("/v1/raw/chat/completions", json=body, headers={"authorization": "Bearer s3cret"})
        assert response.status_code == 200, response.text
        reply = response.json()
        assert reply["usage"]["completion_tokens"] <= 8 and isinstance(reply["choices"][0]["message"]["content"], str)
        assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["usage"]["prompt_tokens"] > 0
        assert client.post("/v1/chat/completions", json=chat()).status_code == 403
        assert client.get("/health").status_code == 200
        bad = client.post("/v1/raw/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                          headers={"authorization": "Bearer s3cret"})
        assert bad.status_code == 422 and "role must be" in bad.json()["error"]["message"]
        bad = client.post("/v1/raw/chat/completions", json={**body, "max_tokens": 0}, headers={"authorization": "Bearer s3cret"})
        assert bad.status_code == 422 and "max_tokens" in bad.json()["error"]["message"]


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()
