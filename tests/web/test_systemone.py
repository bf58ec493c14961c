"""POST /v1/systemone over HTTP: Jev's shapes, the error envelope, limits, encodings, auth."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import zstandard
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from tests.conftest import close
from tests.fakes import ScriptedReader

TICKET = {
    "model": "jev-latest",
    "state": {"ticket": "Everything is down and we have a demo at noon."},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
        "team": {"type": "choice", "instructions": "Which team owns this?",
                 "criteria": {"billing": None, "outage": "service down", "feature": None}},
        "tone": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
    },
}


@pytest.fixture
def tiny(tiny_reader):
    with TestClient(create_app(Settings(), tiny_reader)) as client:
        yield client


@pytest.fixture
def fake(tokenizer):
    reader = ScriptedReader(tokenizer)
    with TestClient(create_app(Settings(), reader)) as client:
        client.reader = reader
        yield client


def assert_envelope(response, status, message_part, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "detail"}
    assert message_part in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param"}
    if param is not None:
        assert body["error"]["param"] == param
    if status == 422:
        assert isinstance(body["detail"], list) and body["detail"][0]["loc"][0] == "body"
        if body["detail"][0]["type"] not in ("json_invalid", "missing"):  # FastAPI's own wording there
            assert body["detail"][0]["msg"] == body["error"]["message"]
    return body


def test_the_readme_example_on_the_tiny_model(tiny):
    response = tiny.post("/v1/systemone", json=TICKET)
    assert response.status_code == 200
    assert response.headers["x-typesafe-request-id"].startswith("req_")
    body = response.json()
    assert body["model"] == "djev-tiny-random"
    assert list(body["answers"]) == ["urgent", "team", "tone"]
    urgent, team, tone = body["answers"].values()
    assert set(urgent) == {"type", "noul"} and 0 <= urgent["noul"] <= 1
    assert team["choice"] in team["probabilities"] and list(team["probabilities"]) == ["billing", "outage", "feature"]
    assert math.isclose(sum(team["probabilities"].values()), 1.0, abs_tol=1e-9)
    assert tone["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert list(tone["probabilities"]) == ["0", "1", "2"]
    assert math.isclose(sum(tone["probabilities"].values()), 1.0, abs_tol=1e-9)
    assert math.isclose(tone["score"], sum(i * p for i, p in enumerate(tone["probabilities"].values())))
    assert isinstance(body["usage"]["input_tokens"], int) and isinstance(body["usage"]["output_tokens"], int)
    assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0
    assert body["diagnostics"]["engine"] == "hf"


def test_unknown_top_level_keys_are_ignored_as_jev_does(fake):
    response = fake.post("/v1/systemone", json={**TICKET, "samples": 1, "x_trace_id": "t-1"})
    assert response.status_code == 200, response.text
    assert response.json()["diagnostics"]["ignored"] == ["x_trace_id"]
    assert "ignored" not in fake.post("/v1/systemone", json={**TICKET, "samples": 1}).json()["diagnostics"]


def test_decisions_alias_and_any_model_id(fake):
    for model in ("jev-latest", "jev-preview", "jev-1.13.0", "anything-at-all", None):
        response = fake.post("/v1/decisions", json={**TICKET, "model": model})
        assert response.status_code == 200 and response.json()["model"] == "dgemma"


def test_unicode_ids_and_option_names_come_back_byte_for_byte(fake):
    body = {"state": "x", "questions": {"élan 🚀": {"type": "choice", "criteria": {"😀 smile": None, "  padded ": None}}}}
    response = fake.post("/v1/systemone", json=body)
    assert response.status_code == 200
    assert "élan 🚀".encode() in response.content  # not \u-escaped
    answer = response.json()["answers"]["élan 🚀"]
    assert list(answer["probabilities"]) == ["😀 smile", "  padded "] and answer["choice"] == "😀 smile"


def test_same_seed_same_answers_on_the_tiny_model(tiny):
    first = tiny.post("/v1/systemone", json={**TICKET, "seed": 5}).json()["answers"]
    again = tiny.post("/v1/systemone", json={**TICKET, "seed": 5}).json()["answers"]
    other = tiny.post("/v1/systemone", json={**TICKET, "seed": 6, "samples": 1}).json()["answers"]
    assert close(first, again)
    assert not close(other, first)


def test_renaming_ids_does_not_change_answers_on_the_tiny_model(tiny):
    renamed = {**TICKET, "questions": {f"other name {i}": q for i, q in enumerate(TICKET["questions"].values())}}
    first = list(tiny.post("/v1/systemone", json=TICKET).json()["answers"].values())
    second = list(tiny.post("/v1/systemone", json=renamed).json()["answers"].values())
    assert close(first, second)


def test_isolate_request_key_and_jev_confidence(fake):
    body = fake.post("/v1/systemone", json={**TICKET, "isolate": True, "confidence": "jev", "samples": 1}).json()
    assert body["diagnostics"]["chunks"] == [["urgent"], ["team"], ["tone"]]
    assert body["answers"]["team"]["confidence"] == pytest.approx((3 * 0.7 - 1) / 2)


def test_server_wide_confidence_and_isolate(tokenizer):
    reader = ScriptedReader(tokenizer)
    with TestClient(create_app(Settings.of(confidence="jev", isolate=True), reader)) as client:
        body = client.post("/v1/systemone", json={**TICKET, "samples": 1}).json()
    assert body["answers"]["team"]["confidence"] == pytest.approx(0.55)
    assert len(body["diagnostics"]["chunks"]) == 3


def test_skipped_questions_are_null(fake):
    body = {**TICKET, "samples": 1, "questions": {
        **TICKET["questions"], "refund": {"type": "noul", "ask_if": {"team": ["outage"]}}}}
    response = fake.post("/v1/systemone", json=body).json()
    assert response["answers"]["refund"] is None
    assert response["diagnostics"]["skipped"]["refund"]["was"] == "billing"


def test_ask_with_a_subset_answers_only_those(fake):
    response = fake.post("/v1/systemone", json={**TICKET, "ask": ["tone"], "samples": 1})
    assert response.status_code == 200
    assert list(response.json()["answers"]) == ["tone"]


def test_models_in_jevs_shape(fake):
    body = fake.get("/v1/models").json()
    names = [m["name"] for m in body["models"]]
    assert names[:2] == ["jev-latest", "jev-preview"] and "dgemma" in names
    assert all(set(m) == {"name", "description", "release_date"} for m in body["models"])


def test_health_says_which_model_answers(tiny):
    body = tiny.get("/health").json()
    assert body["status"] == "ok" and body["ready"] is True
    assert body["model"] == "djev-tiny-random" and body["engine"] == "hf" and body["device"] == "cpu"
    assert body["tiny"] is True and "random" in body["warning"]


BAD_BODIES = [
    ({"state": "x"}, 422, "non-empty map", "questions"),
    ({**TICKET, "questions": {"a": {"type": "rank"}}}, 422, "unknown type", "questions.a.type"),
    ({**TICKET, "questions": {"a": {"type": "choice", "criteria": {}}}}, 422, "map option names", "questions.a.criteria"),
    ({**TICKET, "questions": {"a": {"type": "choice", "criteria": {"x": None}}}}, 422, "at least two", "questions.a.criteria"),
    ({**TICKET, "questions": {"a": {"type": "noul", "depends_on": ["a"]}}}, 422, "unknown question", "questions.a.depends_on"),
    ({**TICKET, "questions": {"a": {"type": "noul", "depends_on": ["b"]}, "b": {"type": "noul", "depends_on": ["a"]}}},
     422, "cycle", "questions"),
    ({**TICKET, "ask": ["nope"]}, 422, "ask must list", "ask"),
    ({**TICKET, "seed": "42"}, 422, "seed", "seed"),
    ({**TICKET, "seed": 1e300}, 422, "seed", "seed"),
    ({**TICKET, "samples": -1}, 422, "samples", "samples"),
    ({**TICKET, "auto_max": "x"}, 422, "auto_max", "auto_max"),
    ({**TICKET, "steps": 100}, 422, "steps", "steps"),
    ({**TICKET, "think": "lots"}, 422, "think must be", "think"),
    ({**TICKET, "state": None}, 422, "state: required", "state"),
    ({**TICKET, "images": ["not an image"]}, 422, "images[0]", "images.0"),
    ({**TICKET, "questions": {"a": {"type": "noul", "bogus": 1}}}, 422, "unknown field 'bogus'", "questions.a.bogus"),
    ([1, 2, 3], 422, "must be a JSON object", None),
    ({**TICKET, "questions": {"a": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}},
     400, "Too many choices", "questions.a.criteria"),
    ({**TICKET, "questions": {"a": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     400, "Too many score levels", "questions.a.criteria"),
    ({**TICKET, "questions": {f"q{i}": {"type": "noul"} for i in range(300)}}, 400, "at most 256 questions", "questions"),
]


@pytest.mark.parametrize("body, status, message, param", BAD_BODIES)
def test_bad_bodies_are_4xx_naming_the_field_and_the_server_stays_healthy(fake, body, status, message, param):
    response = fake.post("/v1/systemone", json=body)
    assert_envelope(response, status, message, param)
    assert response.headers["x-typesafe-request-id"]
    assert fake.get("/health").status_code == 200
    assert fake.post("/v1/systemone", json={**TICKET, "samples": 1}).status_code == 200


def test_jev_limit_errors_carry_jevs_plain_string_detail(fake):
    body = {**TICKET, "questions": {"a": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}}
    assert fake.post("/v1/systemone", json=body).json()["detail"] == "Too many choices. Must have at most 255 choices."
    body = {**TICKET, "questions": {"a": {"type": "score", "criteria": [str(i) for i in range(11)]}}}
    assert fake.post("/v1/systemone", json=body).json()["detail"] == "Too many score levels. Must have at most 10 levels."


# A body that is not JSON is a 422 in FastAPI's shape (json_invalid, loc ["body", position]); an
# empty body is FastAPI's "missing"; JSON past our nesting limit is a 400 (a limit, not a syntax error).
RAW_BODIES = [
    (b"not json", "application/json", 422, "not valid JSON", ("json_invalid", 0, "Expecting value")),
    (b'{"state": "x",}', "application/json", 422, "not valid JSON",
     ("json_invalid", 14, "Expecting property name enclosed in double quotes")),
    (b"", "application/json", 422, "empty", ("missing", None, None)),
    (b'{"state": NaN, "questions": {}}', "application/json", 422, "NaN is not valid JSON",
     ("json_invalid", 0, "NaN is not valid JSON")),
    (b'{"state": Infinity}', "application/json", 422, "Infinity", ("json_invalid", 0, "Infinity is not valid JSON")),
    (b"\xff\xfe garbage", "application/json", 422, "not UTF-8", ("json_invalid", 0, "not UTF-8 text")),
    (b'{"state": "x", "state": "y"}', "application/json", 422, "duplicate key 'state'",
     ("json_invalid", 0, "duplicate key 'state'")),
    (b'{"questions": {"a": {"type": "choice", "criteria": {"x": null, "x": null}}}}', "application/json", 422,
     "duplicate key 'x'", ("json_invalid", 0, "duplicate key 'x'")),
    (b"[" * 5000 + b"]" * 5000, "application/json", 400, "nested", None),
    (b'{"state": {"a": {"b": ' + b"[" * 100 + b"]" * 100 + b"}}}", "application/json", 400, "nested deeper", None),
    (b"<xml/>", "application/xml", 415, "application/xml", None),
]


@pytest.mark.parametrize("raw, content_type, status, message, fastapi", RAW_BODIES)
def test_unparseable_bodies(fake, raw, content_type, status, message, fastapi):
    response = fake.post("/v1/systemone", content=raw, headers={"content-type": content_type})
    body = assert_envelope(response, status, message)
    if fastapi is not None:
        kind, position, error = fastapi
        (detail,) = body["detail"]
        assert detail["type"] == kind and body["error"]["param"] == "body"
        if kind == "json_invalid":
            assert detail["loc"] == ["body", position] and detail["msg"] == "JSON decode error"
            assert error in detail["ctx"]["error"]
        else:
            assert detail == {"loc": ["body"], "msg": "Field required", "type": "missing"}
    assert fake.get("/health").status_code == 200
    assert not fake.reader.reads


def test_a_multipart_request_part_that_is_not_json_is_422_at_its_part(fake):
    files = {"request": (None, b'{"state": ', "application/json")}
    response = fake.post("/v1/systemone", files=files)
    body = assert_envelope(response, 422, "request: not valid JSON", param="request")
    assert body["detail"][0]["loc"] == ["body", "request", 10] and body["detail"][0]["type"] == "json_invalid"


def test_curl_without_a_content_type_still_reads_json(fake):
    data = json.dumps({**TICKET, "samples": 1}).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "application/vnd.api+json"):
        assert fake.post("/v1/systemone", content=data, headers={"content-type": content_type}).status_code == 200


def test_oversized_bodies_are_413_before_parsing(tokenizer):
    reader = ScriptedReader(tokenizer)
    with TestClient(create_app(Settings.of(max_body_bytes=2000), reader)) as client:
        big = {**TICKET, "state": "x" * 5000}
        assert_envelope(client.post("/v1/systemone", json=big), 413, "larger than this server's limit of 2000 bytes")
        # a lying Content-Length is caught while streaming too
        response = client.post("/v1/systemone", content=b"{" + b" " * 5000 + b"}",
                               headers={"content-type": "application/json"})
        assert response.status_code == 413
        bomb = gzip.compress(json.dumps({**TICKET, "state": "y" * 100000}).encode())
        response = client.post("/v1/systemone", content=bomb,
                               headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert_envelope(response, 413, "larger than")
        assert client.post("/v1/systemone", json={**TICKET, "samples": 1}).status_code == 200
        assert reader.reads, "the good request after the bad ones was read"


def test_compressed_bodies(fake):
    data = json.dumps({**TICKET, "samples": 1, "state": "word " * 400}).encode()
    for encoding, packed in (("gzip", gzip.compress(data)), ("zstd", zstandard.ZstdCompressor().compress(data)),
                             ("identity", data)):
        response = fake.post("/v1/systemone", content=packed,
                             headers={"content-type": "application/json", "content-encoding": encoding})
        assert response.status_code == 200, (encoding, response.text)
    response = fake.post("/v1/systemone", content=data, headers={"content-type": "application/json",
                                                                 "content-encoding": "br"})
    assert_envelope(response, 415, "Content-Encoding 'br'")
    response = fake.post("/v1/systemone", content=b"not gzip", headers={"content-type": "application/json",
                                                                        "content-encoding": "gzip"})
    assert_envelope(response, 400, "does not decompress")
    not_json = fake.post("/v1/systemone", content=gzip.compress(b"{oops"),
                         headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert_envelope(not_json, 422, "not valid JSON")


def test_unknown_routes_and_methods(fake):
    assert_envelope(fake.get("/v1/nothing"), 404, "unknown route")
    assert_envelope(fake.get("/v1/systemone"), 405, "Method Not Allowed")


class TestApiKey:
    @pytest.fixture
    def keyed(self, tokenizer):
        with TestClient(create_app(Settings.of(api_key="s3cret"), ScriptedReader(tokenizer))) as client:
            yield client

    def test_missing_header_is_403_and_wrong_key_401(self, keyed):
        body = assert_envelope(keyed.post("/v1/systemone", json=TICKET), 403, "Must supply an API key")
        assert body["detail"]["error_type"] == "authentication_error"
        assert_envelope(keyed.post("/v1/systemone", json=TICKET, headers={"authorization": "Bearer nope"}),
                        401, "Cannot authenticate")
        assert_envelope(keyed.post("/v1/systemone", json=TICKET, headers={"authorization": "s3cret"}), 401,
                        "Cannot authenticate")
        assert keyed.post("/v1/nowhere", json={}).status_code == 403  # checked before the route

    def test_right_key_passes_and_get_routes_stay_open(self, keyed):
        ok = keyed.post("/v1/systemone", json={**TICKET, "samples": 1}, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert keyed.get("/health").status_code == 200
        assert keyed.get("/v1/models").status_code == 200

    def test_health_says_whether_a_key_is_required(self, keyed, fake):
        assert keyed.get("/health").json()["auth"] is True
        assert fake.get("/health").json()["auth"] is False

    def test_without_a_key_any_authorization_is_accepted(self, fake):
        response = fake.post("/v1/systemone", json={**TICKET, "samples": 1}, headers={"authorization": "Bearer x"})
        assert response.status_code == 200


def test_overload_is_529_with_retry_after(tokenizer):
    reader = ScriptedReader(tokenizer)
    app = create_app(Settings.of(max_inflight=1), reader)
    with TestClient(app) as client:
        app.state.services.admission.in_flight = 1  # one decision is in flight
        response = client.post("/v1/systemone", json=TICKET)
        assert_envelope(response, 529, "overloaded")
        assert response.headers["retry-after"] == "1" and response.headers["retry-after-ms"] == "1000"
        app.state.services.admission.in_flight = 0
        assert client.post("/v1/systemone", json={**TICKET, "samples": 1}).status_code == 200


def test_engine_failures_are_502_and_503(tokenizer):
    from app.engine.base import EngineError, EngineUnavailable

    class Broken(ScriptedReader):
        def __init__(self, error):
            super().__init__(tokenizer)
            self.error = error

        async def read(self, specs):
            raise self.error

    for error, status in ((EngineError("boom"), 502), (EngineUnavailable("stopped"), 503)):
        with TestClient(create_app(Settings(), Broken(error))) as client:
            assert_envelope(client.post("/v1/systemone", json=TICKET), status, "engine")


def test_a_prompt_past_the_context_is_jevs_max_tokens_exceeded(tiny_dir):
    from tests.conftest import make_tiny_reader

    reader = make_tiny_reader(tiny_dir, max_prompt_tokens=200)
    with TestClient(create_app(Settings(), reader)) as client:
        response = client.post("/v1/systemone", json={**TICKET, "state": "word " * 500})
        body = assert_envelope(response, 400, "this server reads at most 200")
        assert body["detail"]["error_type"] == "max_tokens_exceeded"
        assert client.post("/v1/systemone", json={**TICKET, "samples": 1}).status_code == 200


def test_the_json_depth_limit_counts_nesting_not_brackets():
    """The depth walk is skipped for bodies with few brackets; past that, nesting decides, not how
    many brackets a body has (a wide, shallow body passes; 65 levels anywhere is refused)."""
    import json

    from app.web.body import MAX_JSON_DEPTH, parse_json
    from app.web.errors import HTTPError

    wide = {"state": "x", "lists": [[i] for i in range(3 * MAX_JSON_DEPTH)]}  # many brackets, depth 3
    assert parse_json(json.dumps(wide).encode()) == wide
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(at_limit.encode()) is not None
    over = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    try:
        parse_json(over.encode())
    except HTTPError as exc:
        assert exc.status == 400 and "nested deeper" in str(exc)
    else:
        raise AssertionError("65 levels of nesting were accepted")
