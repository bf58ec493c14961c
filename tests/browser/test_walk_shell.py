"""The walk page installs: its web app manifest and icons load, and its service worker keeps the page
shell only. In headless chromium on http://127.0.0.1 (a secure context, so the worker registers):
an API response is never served from the worker, a changed walk.js is served fresh, and with the
server gone the shell still opens while the API fails."""

from __future__ import annotations

import io
import json
import re

from PIL import Image
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from app.web.pages import APP_DIR
from tests.browser.conftest import screenshot
from tests.browser.test_walk import PHONE, TIMEOUT_MS
from tests.conftest import live_server
from tests.fakes import ScriptedReader

SW_SOURCE = (APP_DIR / "static" / "walk" / "sw.js").read_text()
SHELL = re.findall(r'^  "(/[^"]*)",$', SW_SOURCE, flags=re.M)
CACHE = re.search(r'const CACHE = "([^"]+)"', SW_SOURCE).group(1)


def test_the_manifest_and_its_icons_load(tokenizer):
    with TestClient(create_app(Settings(), ScriptedReader(tokenizer))) as client:
        html = client.get("/walk").text
        assert '<link rel="manifest" href="/walk.webmanifest">' in html
        response = client.get("/walk.webmanifest")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/manifest+json")
        manifest = json.loads(response.text)
        assert manifest["start_url"] == "/walk" and manifest["scope"] == "/walk"
        assert manifest["display"] == "fullscreen" and manifest["name"] == "djev walk"
        sizes = set()
        for icon in manifest["icons"]:
            image = client.get(icon["src"])
            assert image.status_code == 200, icon
            assert image.headers["content-type"].startswith(icon["type"]), icon
            if icon["type"] == "image/png":
                width, height = Image.open(io.BytesIO(image.content)).size
                assert f"{width}x{height}" == icon["sizes"], icon
                sizes.add(width)
        assert {192, 512} <= sizes  # what Android asks for to install
        assert any(icon.get("purpose") == "maskable" for icon in manifest["icons"])
        touch = re.search(r'<link rel="apple-touch-icon" href="([^"]+)">', html).group(1)
        assert Image.open(io.BytesIO(client.get(touch).content)).size == (180, 180)

        worker = client.get("/sw.js")
        assert worker.status_code == 200 and worker.headers["content-type"].startswith("text/javascript")
        assert worker.headers["cache-control"] == "no-cache"
        # Every shell path the worker keeps exists (install fetches them all), and none is the API.
        assert "/walk" in SHELL and "/static/js/walk.js" in SHELL and len(SHELL) >= 10
        for path in SHELL:
            assert client.get(path).status_code == 200, path
            assert not path.startswith(("/v1", "/health")), path


def test_no_pages_means_no_manifest_or_worker(tokenizer):
    with TestClient(create_app(Settings.of(pages=False), ScriptedReader(tokenizer))) as client:
        assert client.get("/walk.webmanifest").status_code == 404
        assert client.get("/sw.js").status_code == 404


class Versions:
    """walk.js as served: the real file plus a line that stamps the running page with a version the
    test changes, and an API route that answers differently every time."""

    def __init__(self) -> None:
        self.version = 1
        self.probes = 0
        self.source = (APP_DIR / "static" / "js" / "walk.js").read_text()

    async def walk_js(self, request: Request) -> Response:
        stamp = f'\ndocument.body.dataset.walkVersion = "{self.version}";\n'
        return Response(self.source + stamp, media_type="text/javascript")

    async def probe(self, request: Request) -> Response:
        self.probes += 1
        return PlainTextResponse(str(self.probes))


def shell_app(tokenizer, versions: Versions):
    app = create_app(Settings(), ScriptedReader(tokenizer), extra_routes=[Route("/v1/probe", versions.probe)])
    app.router.routes.insert(0, Route("/static/js/walk.js", versions.walk_js))  # ahead of the static mount
    return app


def cached_paths(page) -> list[str]:
    return page.evaluate(f"""async () => {{
        const cache = await caches.open({CACHE!r});
        return (await cache.keys()).map((request) => new URL(request.url).pathname);
    }}""")


def fetch_text(page, path: str):
    return page.evaluate(f"""async () => {{
        try {{ const r = await fetch({path!r}); return [r.status, await r.text()]; }}
        catch (err) {{ return ["failed", String(err)]; }}
    }}""")


def test_the_service_worker_keeps_the_shell_never_an_answer(tokenizer, page_factory):
    versions = Versions()
    with live_server(shell_app(tokenizer, versions)) as url:
        page = page_factory(**PHONE)
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda message: "Content Security Policy" in message.text and errors.append(message.text))
        page.goto(f"{url}/walk")
        page.wait_for_function("() => document.body.dataset.shell === 'registered'")
        page.wait_for_function("() => navigator.serviceWorker.controller !== null")
        assert page.evaluate("navigator.serviceWorker.controller.scriptURL") == f"{url}/sw.js"
        page.wait_for_function(f"async () => (await (await caches.open({CACHE!r})).keys()).length >= {len(SHELL)}")
        assert sorted(cached_paths(page)) == sorted(SHELL)

        # Under the worker, the API answers from the server every time, and nothing of it is kept.
        assert fetch_text(page, "/v1/probe") == [200, "1"]
        assert fetch_text(page, "/v1/probe") == [200, "2"]
        assert fetch_text(page, "/v1/models")[0] == 200
        assert not [path for path in cached_paths(page) if not path.startswith(("/walk", "/static/"))]

        # A new walk.js wins on the next load.
        page.reload()
        page.wait_for_function("() => navigator.serviceWorker.controller !== null")
        assert page.get_attribute("body", "data-walk-version") == "1"
        versions.version = 2
        page.reload()
        assert page.get_attribute("body", "data-walk-version") == "2"
        assert fetch_text(page, "/static/js/walk.js")[1].endswith('walkVersion = "2";\n')
        # The page still works under the worker: Start streams over the websocket.
        page.goto(f"{url}/walk?stale_ms=600000")
        page.tap("#toggle")
        page.wait_for_function("() => Number(document.getElementById('banner').dataset.frames || 0) >= 1")
        page.tap("#toggle")

    # The server is gone: the shell opens from the worker's copy (the latest walk.js), the API fails.
    assert fetch_text(page, "/v1/probe")[0] == "failed"
    assert fetch_text(page, "/v1/models")[0] == "failed"
    page.reload()
    assert page.text_content("#banner") == "tap start"
    assert page.get_attribute("body", "data-walk-version") == "2"
    screenshot(page, "walk-shell-offline")
    assert errors == []
