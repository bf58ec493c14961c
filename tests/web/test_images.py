"""Images in decisions over HTTP on the tiny model (its real vision tower): curl/FormData multipart,
the official client's asset form, JSON images; every limit and corrupt input is its own 4xx."""

from __future__ import annotations

import base64
import io
import json

import pytest
import typesafe_sdk as ts
from PIL import Image
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from tests.conftest import live_server, make_tiny_reader

REQUEST = {
    "model": "jev-latest",
    "state": {"note": "the photo is from the returns desk"},
    "samples": 1,
    "questions": {
        "damaged": {"type": "noul", "instructions": "Is the item damaged?"},
        "kind": {"type": "choice", "instructions": "What is it?", "criteria": {"box": None, "bag": None}},
    },
}


def png(size=(64, 48), color=(200, 40, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def jpeg(size=(64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 120, 200)).save(out, "JPEG")
    return out.getvalue()


def data_url(data: bytes, kind="png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def form(request: dict, *files) -> dict:
    return {"request": (None, json.dumps(request), "application/json"), **{
        name: (filename, data, content_type) for name, filename, data, content_type in files}}


@pytest.fixture
def client(tiny_dir):
    with TestClient(create_app(Settings(), make_tiny_reader(tiny_dir))) as c:
        yield c


@pytest.fixture
def small_limits(tiny_dir):
    settings = Settings.of(max_images=2, max_image_bytes=4000, max_total_image_bytes=6000, max_image_pixels=100 * 100)
    with TestClient(create_app(settings, make_tiny_reader(tiny_dir))) as c:
        yield c


def text_only_tokens(client) -> int:
    return client.post("/v1/systemone", json=REQUEST).json()["usage"]["input_tokens"]


def test_multipart_with_image_parts_of_any_name(client):
    files = form(REQUEST, ("photo", "a.png", png(), "image/png"), ("second", "b.jpg", jpeg(), "image/jpeg"))
    response = client.post("/v1/systemone", files=files)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body["answers"]) == {"damaged", "kind"}
    # two images of soft tokens each sit in the prompt ahead of the state
    assert body["usage"]["input_tokens"] > text_only_tokens(client) + 2 * 20


def test_json_images_in_both_forms(client):
    jpeg_object = {"content_type": "image/jpeg", "base64": base64.b64encode(jpeg()).decode()}
    request = {**REQUEST, "images": [data_url(png()), jpeg_object]}
    response = client.post("/v1/systemone", json=request)
    assert response.status_code == 200
    assert response.json()["usage"]["input_tokens"] > text_only_tokens(client) + 2 * 20


def test_the_official_clients_asset_form(tiny_dir):
    app = create_app(Settings(), make_tiny_reader(tiny_dir))
    with live_server(app) as url, ts.TypeSafeClient(api_key="x", base_url=url) as sdk:
        photo = ts.Image(png())
        result = sdk.system_one(
            {"note": f"the photo {photo} is from the returns desk"},
            {"damaged": ts.Noul(instructions="Is the item damaged?")},
            extra_body={"samples": 1},
        )
        assert 0 <= result.nouls["damaged"].noul <= 1
        assert result.raw_http_response.json()["diagnostics"]["prompt_tokens"] > 60


def test_the_asset_form_by_hand_replaces_references(client):
    reference = "<image:" + "ab" * 16 + ">"
    request = {**REQUEST, "state": f"look at {reference}", "assets": {reference: {"type": "image", "part": "asset-0"}}}
    files = {"request": (None, json.dumps(request)), "asset-0": ("asset-0", png(), "application/octet-stream")}
    assert client.post("/v1/systemone", files=files).status_code == 200
    bad = {**request, "assets": {reference: {"type": "image", "part": "asset-9"}}}
    response = client.post("/v1/systemone", files={"request": (None, json.dumps(bad)),
                                                   "asset-0": ("asset-0", png(), "application/octet-stream")})
    assert response.status_code == 422 and "no part 'asset-9'" in response.json()["error"]["message"]


def test_image_states_in_later_stages_are_restated(client):
    request = {**REQUEST, "questions": {**REQUEST["questions"],
                                        "why": {"type": "noul", "instructions": "Is it torn?", "depends_on": ["damaged"]}}}
    response = client.post("/v1/systemone", files=form(request, ("photo", "a.png", png(), "image/png")))
    diagnostics = response.json()["diagnostics"]
    assert diagnostics["conditioning"] == "restated" and diagnostics["stages"] == [["damaged", "kind"], ["why"]]


def test_image_think_is_seeded_into_the_canvas_and_clipped(client):
    response = client.post("/v1/systemone", files=form({**REQUEST, "think": 4096},
                                                       ("photo", "a.png", png(), "image/png")))
    assert response.status_code == 200, response.text
    thought = response.json()["diagnostics"]["thought"]
    assert thought["budget"] < 4096 and thought["tokens"] <= thought["budget"]


def test_sequential_with_images_is_restated(client):
    request = {**REQUEST, "sequential": True, "chunk_rows": 8}
    response = client.post("/v1/systemone", json={**request, "images": [data_url(png())]})
    assert response.status_code == 200 and response.json()["diagnostics"]["conditioning"] == "restated"


def check_error(response, status, *parts):
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for part in parts:
        assert part in message, message


@pytest.mark.parametrize("make, status, parts", [
    (lambda: form(REQUEST, *[(f"p{i}", "a.png", png(), "image/png") for i in range(3)]), 400, ["at most 2 images"]),
    (lambda: form(REQUEST, ("big", "a.png", png((300, 300)) + b"\0" * 5000, "image/png")), 413,
     ["part 'big'", "at most 4000 bytes"]),
    (lambda: form(REQUEST, ("a", "a.png", png() + b"\0" * 3000, "image/png"), ("b", "b.png", png() + b"\0" * 3000, "image/png")),
     413, ["at most 6000 bytes of images"]),
    (lambda: form(REQUEST, ("wide", "w.png", png((400, 30)), "image/png")), 400, ["part 'wide'", "400x30", "pixels"]),
    (lambda: form(REQUEST, ("junk", "j.png", b"this is not a png at all", "image/png")), 422, ["part 'junk'", "not an image"]),
    (lambda: form(REQUEST, ("empty", "e.png", b"", "image/png")), 422, ["part 'empty'", "empty"]),
    (lambda: form(REQUEST, ("tiff", "t.tiff", _tiff(), "image/tiff")), 422, ["part 'tiff'", "TIFF"]),
    (lambda: form(REQUEST, ("notes", "n.txt", b"hello", "text/plain")), 400, ["part 'notes'", "neither"]),
    (lambda: {"photo": ("a.png", png(), "image/png")}, 400, ["part named request"]),
])
def test_multipart_limits_and_bad_parts(small_limits, make, status, parts):
    check_error(small_limits.post("/v1/systemone", files=make()), status, *parts)
    assert small_limits.get("/health").status_code == 200
    assert small_limits.post("/v1/systemone", json=REQUEST).status_code == 200


@pytest.mark.parametrize("images, status, parts", [
    ([data_url(png())] * 3, 400, ["at most 2 images"]),
    ([data_url(png((300, 300))) + "A" * 8000], 413, ["images[0]", "at most 4000 bytes"]),
    (["data:image/png;base64," + base64.b64encode(b"garbage bytes").decode()], 422, ["images[0]", "not an image"]),
    (["data:image/png;base64,%%%"], 422, ["images[0]", "does not decode"]),
    ([42], 422, ["images[0]"]),
])
def test_json_image_limits_and_bad_data(small_limits, images, status, parts):
    check_error(small_limits.post("/v1/systemone", json={**REQUEST, "images": images}), status, *parts)
    assert small_limits.post("/v1/systemone", json=REQUEST).status_code == 200


def _tiff() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "TIFF")
    return out.getvalue()
