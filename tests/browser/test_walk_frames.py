"""The frames the pages stream: the walk page and the playground's realtime mode both scale the
camera (640x480 here) to 512 px wide, height by aspect, as JPEG."""

from __future__ import annotations

import io

from PIL import Image

from tests.browser.test_walk import PHONE, TIMEOUT_MS, ScriptedStream
from tests.browser.test_walk_aid import fast_server  # noqa: F401 - the fixture


def frame_size(stream: ScriptedStream) -> tuple[int, int]:
    stream.wait_frames(1)
    image = Image.open(io.BytesIO(stream.last_frame))
    assert image.format == "JPEG"
    return image.size


def test_walk_frames_are_512_wide(fast_server, page_factory):  # noqa: F811
    page = page_factory(**PHONE)
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{fast_server}/walk?stale_ms=600000")
    stream = ScriptedStream(page)
    page.tap("#toggle")
    assert frame_size(stream) == (512, 384)


def test_playground_realtime_frames_are_512_wide_like_walks(fast_server, page_factory):  # noqa: F811
    page = page_factory()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{fast_server}/")
    stream = ScriptedStream(page)
    page.select_option("#mode", "realtime")
    page.wait_for_function("() => document.getElementById('status').textContent === 'camera on'")
    page.click("#rt-toggle")
    assert frame_size(stream) == (512, 384)
    assert page.evaluate("document.getElementById('video').videoWidth") == 640  # the camera's own width
