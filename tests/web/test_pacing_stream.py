"""Camera sessions under load, over a real uvicorn server with a slow batching engine (tests/fakes.py
BatchingReader: 2 reads a 0.1 s pass, 20 frames/s): admission at open by the pacer's capacity,
next_frame_ms in `ready` and every `result` rising with load, paced sessions whose answers stay
fresh while the estimate learns the engine, and /metrics counting it."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from app.config import Settings
from app.server import create_app
from app.web.errors import CLOSE_TRY_LATER
from tests.conftest import live_server
from tests.fakes import BatchingReader
from tests.web.test_metrics import parse, value
from tests.web.test_stream import GREY, WALK, closed_with, receive, ws_url

# 20 frames/s, more than the prior (8): the pacer has something to learn. A pass (0.1 s) is well under
# the sessions' intervals, so four sessions can draw more than the prior from it.
BATCH, PASS_S = 2, 0.1
FRESH_S = 1.5  # the walk page's guard on the age of the answer it shows
FULL = "the server is at its camera capacity: 4 sessions at ~2.0 answers/s each; try again later"


@pytest.fixture
def loaded(tokenizer):
    reader = BatchingReader(tokenizer, batch=BATCH, pass_s=PASS_S)
    app = create_app(Settings.of(session_window=1.0), reader)
    with live_server(app) as url:
        yield url, app.state.services.pacer, reader


def opened(url: str) -> tuple[ClientConnection, dict]:
    ws = connect(ws_url(url))
    ready = receive(ws, "ready", timeout=10)
    ws.send(json.dumps({"type": "config", "request": WALK}))
    receive(ws, "configured", timeout=10)
    return ws, ready


class PacedCamera(threading.Thread):
    """A client that does what the pages do: one frame in flight, the next no sooner than
    next_frame_ms after the previous send and not before the answer."""

    def __init__(self, ws: ClientConnection, ready: dict, seconds: float) -> None:
        super().__init__(daemon=True)
        self.ws, self.interval_ms, self.seconds = ws, ready["next_frame_ms"], seconds
        self.results: list[dict] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                sent = time.monotonic()
                self.ws.send(GREY)
                result = receive(self.ws, "result", timeout=10)
                self.results.append(result)
                self.interval_ms = result["next_frame_ms"]
                time.sleep(max(0.0, sent + self.interval_ms / 1000 - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def run_cameras(url: str, count: int, seconds: float) -> list[PacedCamera]:
    """`count` paced cameras run together for `seconds`, each without a failure; their sockets open."""
    cameras = [PacedCamera(*opened(url), seconds=seconds) for _ in range(count)]
    for camera in cameras:
        camera.start()
    for camera in cameras:
        camera.join(timeout=20)
    assert all(camera.failure is None for camera in cameras), [camera.failure for camera in cameras]
    return cameras


def test_one_session_past_the_capacity_is_refused_at_open_and_the_pace_rises_with_load(loaded):
    url, pacer, _ = loaded
    sessions = [opened(url) for _ in range(4)]
    try:
        # 8 frames/s assumed until measured, shared out, never faster than MAX_SESSION_FPS (4).
        assert [ready["next_frame_ms"] for _, ready in sessions] == [250, 250, 375, 500]
        # (4 + 1) x MIN_SESSION_FPS 1.5 > 8 x SESSION_HEADROOM 0.8: the fifth is refused before `ready`.
        with connect(ws_url(url)) as extra:
            assert closed_with(extra, CLOSE_TRY_LATER) == FULL
        assert len(pacer.sessions) == 4
        metrics = parse(httpx.get(url + "/metrics").text)
        assert value(metrics, "djev_stream_sessions_opened_total", result="admitted") == 4
        assert value(metrics, "djev_stream_sessions_opened_total", result="refused_load") == 1
        assert value(metrics, "djev_stream_capacity_fps") == 8 and value(metrics, "djev_stream_next_frame_ms") == 500
        # The admitted ones are served, and their results carry the pace.
        ws, _ = sessions[0]
        ws.send(GREY)
        assert receive(ws, "result")["next_frame_ms"] == 500
    finally:
        for ws, _ in sessions:
            ws.close()
    deadline = time.monotonic() + 10
    while pacer.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pacer.sessions
    ws, ready = opened(url)  # room again
    assert ready["next_frame_ms"] == 250
    ws.close()


def test_paced_sessions_stay_fresh_while_the_estimate_learns_the_engine(loaded):
    url, pacer, reader = loaded
    cameras = run_cameras(url, 4, seconds=6.0)
    # Every answer the four got, their next_frame_ms included, was fresh enough to walk with.
    ages = [(r["timing"]["total_ms"] + r["next_frame_ms"]) / 1000 for camera in cameras for r in camera.results]
    assert max(ages) < FRESH_S, sorted(ages)[-5:]
    # At least MIN_SESSION_FPS each, over 6 s (the first second at the prior's pace).
    assert all(len(camera.results) >= 1.5 * 6 for camera in cameras), [len(c.results) for c in cameras]
    # The engine kept up at the prior's pace, so the pacer probed higher and saw more answered.
    assert pacer.capacity > 8 and pacer.last_window is not None
    assert min(r["next_frame_ms"] for camera in cameras for r in camera.results[-3:]) < 500
    assert max(reader.passes) <= BATCH
    # What was measured admits a fifth camera the prior had no room for; none was ever closed.
    assert (4 + 1) * 1.5 <= pacer.capacity * 0.8, pacer.capacity
    fifth, ready = opened(url)
    assert ready["next_frame_ms"] == max(250, math.ceil(5000 / pacer.pace))
    assert len(pacer.sessions) == 5
    fifth.close()
    for camera in cameras:
        camera.ws.send(GREY)  # still open and served
        try:
            assert receive(camera.ws, "result", timeout=10)["frame"] == len(camera.results) + 1
        except ConnectionClosed as closed:  # pragma: no cover - the failure this test guards against
            pytest.fail(f"an admitted session was closed: {closed}")
        camera.ws.close()
    metrics = parse(httpx.get(url + "/metrics").text)
    answered = sum(len(camera.results) for camera in cameras) + 4
    assert value(metrics, "djev_stream_age_before_next_seconds_count") == answered
    assert value(metrics, "djev_stream_age_before_next_seconds_bucket", le="1.5") == answered
    assert value(metrics, "djev_stream_capacity_fps") == pytest.approx(pacer.capacity)


def test_an_engine_that_says_it_is_mostly_idle_admits_many_more_cameras_within_a_window(tokenizer):
    """With the engine's busy time (BatchingReader reporting `busy_ms`, as the hf engine does), two
    paced cameras on a nearly idle engine (8 frames/s for 0.01 s a pass) are enough for the estimate
    to extrapolate: many more sessions are admitted than the prior's four, with no probing."""
    reader = BatchingReader(tokenizer, batch=8, pass_s=0.01, report_busy=True)
    app = create_app(Settings.of(session_window=1.0), reader)
    with live_server(app) as url:
        pacer = app.state.services.pacer
        cameras = run_cameras(url, 2, seconds=3.5)
        assert pacer.measured and pacer.capacity >= 20, (pacer.capacity, pacer.last_window)
        more = [opened(url) for _ in range(10)]  # twelve in all, three times the prior's four
        assert len(pacer.sessions) == 12
        for ws, _ in more:
            ws.close()
        for camera in cameras:
            camera.ws.close()


def test_cameras_are_admitted_from_the_frame_rate_the_engine_measured_at_start_up(tokenizer):
    """An engine whose ReaderInfo says it read 40 frames a second at start-up (the hf engine's frame
    probe): twenty cameras opened at once are all admitted, before any window has measured."""
    reader = BatchingReader(tokenizer, batch=8, pass_s=0.01)
    reader.info = dataclasses.replace(reader.info, frame_rate=40.0)
    app = create_app(Settings.of(session_window=1.0), reader)
    with live_server(app) as url:
        pacer = app.state.services.pacer
        cameras = [opened(url) for _ in range(20)]
        assert len(pacer.sessions) == 20 and not pacer.measured
        metrics = parse(httpx.get(f"{url}/metrics").text)
        assert value(metrics, "djev_stream_capacity_fps") == pytest.approx(40.0)
        for ws, _ in cameras:
            ws.close()
