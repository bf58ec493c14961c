"""Browser-test fixtures: Debian's chromium through Playwright with a fake camera fed from a .y4m
file the tests write, and live tiny-model servers (HTTP, and HTTPS with the self-signed certificate).
Screenshots go to test-artifacts/ at the repository root."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from app.config import Settings
from app.server import create_app
from tests.conftest import ARTIFACTS, live_server, make_tiny_reader

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]


def write_y4m(path: Path, width: int = 640, height: int = 480, frames: int = 48) -> Path:
    """A short 4:2:0 video for chromium's fake camera: a grey room with a dark box sliding across."""
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{width} H{height} F15:1 Ip A1:1 C420jpeg\n".encode())
        for index in range(frames):
            luma = np.full((height, width), 150, dtype=np.uint8)
            luma[height // 2:, :] = 110  # the floor
            x = int((index / frames) * (width - 160))
            luma[height // 3: height // 3 + 200, x: x + 160] = 40  # the obstacle
            chroma = np.full((height // 2, width // 2), 128, dtype=np.uint8)
            out.write(b"FRAME\n")
            out.write(luma.tobytes())
            out.write(chroma.tobytes())
            out.write(chroma.tobytes())
    return path


@pytest.fixture(scope="session")
def camera_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_y4m(tmp_path_factory.mktemp("camera") / "camera.y4m")


# Module scope: Playwright's sync API keeps an event loop running in this thread while a browser is
# open, and other test modules call asyncio.run().
@pytest.fixture(scope="module")
def browser(camera_file: Path):
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: scripts/setup.sh --test installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-video-capture={camera_file}"],
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page_factory(browser):
    """New pages in a fresh context (camera allowed, self-signed certificates accepted)."""
    contexts = []

    def make(viewport: dict | None = None, **options):
        context = browser.new_context(
            viewport=viewport or {"width": 1280, "height": 900},
            ignore_https_errors=True,
            permissions=["camera"],
            **options,
        )
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


@pytest.fixture
def page_server(tiny_dir) -> Iterator[str]:
    """The tiny model with pages on, over plain HTTP on 127.0.0.1 (a secure origin for the camera)."""
    with live_server(create_app(Settings(), make_tiny_reader(tiny_dir))) as url:
        yield url


@pytest.fixture
def tls_server(tiny_dir, tmp_path) -> Iterator[tuple[str, Path]]:
    """The tiny model with pages on, over HTTPS with a freshly generated self-signed certificate."""
    from app.tls import ensure_certificate

    cert, key = ensure_certificate(tmp_path / "certs")
    app = create_app(Settings(), make_tiny_reader(tiny_dir))
    with live_server(app, ssl_certfile=cert, ssl_keyfile=key) as url:
        yield url, Path(cert)
