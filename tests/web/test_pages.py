"""The pages over plain HTTP (no browser): on by default, off with --no-pages, the shared header
says which model answers, the tiny banner shows, nothing loads from outside the server."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from tests.fakes import ScriptedReader


@pytest.fixture
def client(tiny_reader):
    with TestClient(create_app(Settings(), tiny_reader)) as c:
        yield c


@pytest.mark.parametrize("path, marker", [
    ("/", "djev playground"), ("/playground", "djev playground"), ("/walk", "/static/js/walk.js"),
    ("/cube", "Cube Rule Live"),
])
def test_pages_render_with_the_shared_header_and_tiny_banner(client, path, marker):
    response = client.get(path)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert marker in html
    assert 'class="served"' in html and "djev-tiny-random · hf · cpu" in html
    assert 'id="tiny-banner"' in html and "random" in html


def test_the_walk_page_asks_the_hazard_question_with_the_back_camera(client):
    script = client.get("/static/js/walk.js").text
    assert "all clear ahead" in script and "environment" in script and "ask_if" in script


def test_pages_load_nothing_from_outside_the_server(client):
    for path in ("/", "/walk", "/cube"):
        html = client.get(path).text
        for url in re.findall(r'(?:src|href)="([^"]+)"', html):
            assert url.startswith(("/", "#", "data:")), f"{path} loads {url}"
            if url.startswith("/static/"):
                assert client.get(url).status_code == 200, url
    for script in ("api.js", "camera.js", "playground.js", "walk.js", "cube.js"):
        source = client.get(f"/static/js/{script}").text
        assert not re.search(r"https?://(?!127\.0\.0\.1|localhost)", source.replace("http://www.w3.org", "")), script


def test_no_banner_for_a_real_model(tokenizer):
    with TestClient(create_app(Settings(), ScriptedReader(tokenizer))) as c:
        html = c.get("/walk").text
    assert "dgemma · fake · cpu" in html and 'id="tiny-banner"' not in html


def test_no_pages_turns_them_off(tiny_reader):
    with TestClient(create_app(Settings.of(pages=False), tiny_reader)) as c:
        for path in ("/", "/walk", "/cube", "/static/js/api.js"):
            response = c.get(path)
            assert response.status_code == 404 and response.json()["error"]["message"] == "unknown route"
        assert c.get("/health").status_code == 200
