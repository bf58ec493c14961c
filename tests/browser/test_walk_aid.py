"""The walk page as a walking aid, in headless chromium on a phone-sized viewport: what it says
(speechSynthesis), how it buzzes (navigator.vibrate), the screen lock (navigator.wakeLock) and full
screen, all recorded by an init script that stands in for the browser's APIs; and the stale guard:
an answer older than the limit, a dropped socket, a stopped server or a stopped camera become
"no answer — stop", never the last label."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Iterator

import pytest

from app.config import Settings
from app.server import create_app
from tests.browser.conftest import screenshot
from tests.browser.test_walk import LABELS, PHONE, TIMEOUT_MS, ScriptedStream, hazard, wait_frames
from tests.conftest import free_port, live_server
from tests.fakes import ScriptedReader

NO_ANSWER = "no answer — stop"
DANGER_BUZZ = [120, 80, 120, 80, 120]
NO_ANSWER_BUZZ = [700]

# Records what the page asks of the browser. Visibility is the test's to change (__walkHide).
RECORDER = """
(() => {
  const log = window.__walk = { said: [], cancels: 0, buzz: [], locks: 0, releases: 0, fullscreen: 0, banners: [] };
  class Utterance { constructor(text) { this.text = text; this.lang = ""; this.voice = null; } }
  const synth = {
    speaking: false, pending: false, paused: false,
    speak(u) { log.said.push({ text: u.text, lang: u.lang }); },
    cancel() { log.cancels += 1; },
    getVoices() { return []; },
  };
  if (!window.__noSpeech) {
    Object.defineProperty(window, "speechSynthesis", { value: synth, configurable: true });
    Object.defineProperty(window, "SpeechSynthesisUtterance", { value: Utterance, configurable: true, writable: true });
  }
  Object.defineProperty(Navigator.prototype, "vibrate", {
    value(pattern) { log.buzz.push(pattern); return true; }, configurable: true });
  const wakeLock = { request(type) {
    log.locks += 1;
    const sentinel = new EventTarget();
    sentinel.type = type;
    sentinel.release = async () => { log.releases += 1; sentinel.dispatchEvent(new Event("release")); };
    return Promise.resolve(sentinel);
  } };
  Object.defineProperty(Navigator.prototype, "wakeLock", { get: () => wakeLock, configurable: true });
  Element.prototype.requestFullscreen = function () { log.fullscreen += 1; return Promise.resolve(); };
  let hidden = false;
  Object.defineProperty(Document.prototype, "hidden", { get: () => hidden, configurable: true });
  Object.defineProperty(Document.prototype, "visibilityState", {
    get: () => (hidden ? "hidden" : "visible"), configurable: true });
  window.__walkHide = (value) => { hidden = value; document.dispatchEvent(new Event("visibilitychange")); };
  document.addEventListener("DOMContentLoaded", () => {
    const banner = document.getElementById("banner");
    new MutationObserver(() => log.banners.push(banner.textContent)).observe(banner, { childList: true });
  });
})();
"""
NO_SPEECH = """Object.defineProperty(window, "speechSynthesis", { value: undefined, configurable: true });
window.__noSpeech = true;"""


def open_walk(page_factory, url: str, query: str = "", no_speech: bool = False):
    page = page_factory(**PHONE)
    if no_speech:
        page.context.add_init_script(NO_SPEECH)
    page.context.add_init_script(RECORDER)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda message: csp_violation(message.text) and errors.append(message.text))
    page.errors = errors
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{url}/walk{query}")
    return page


def csp_violation(text: str) -> bool:
    # Every page carries a Content-Security-Policy: nothing inline, nothing evaluated, nothing from outside.
    return "Content Security Policy" in text


def log(page) -> dict:
    return page.evaluate("window.__walk")


def said(page) -> list[str]:
    return [entry["text"] for entry in log(page)["said"]]


def banner(page) -> str:
    return page.text_content("#banner")


def wait_banner(page, text: str, timeout_ms: int = TIMEOUT_MS) -> None:
    page.wait_for_function(f"() => document.getElementById('banner').textContent === {text!r}", timeout=timeout_ms)


def shown(page, text: str) -> None:
    """`text` was on the banner at some point since the recorder started."""
    page.wait_for_function(f"() => window.__walk.banners.includes({text!r})")


def wait_said(page, text: str) -> None:
    page.wait_for_function(f"() => window.__walk.said.some(s => s.text === {text!r})")


def answer(stream: ScriptedStream, label: str, side: str | None = None) -> None:
    side_answer = None if side is None else {
        "type": "choice", "choice": f"{side} half", "confidence": 0.9,
        "probabilities": {"left half": 0.9 if side == "left" else 0.1, "right half": 0.1 if side == "left" else 0.9}}
    stream.answer({"type": "result", "answers": {"ahead": hazard(label, 0.8), "side": side_answer},
                   "diagnostics": {"thought": None}, "timing": {"total_ms": 3}, "dropped": [], "dropped_total": 0})


@pytest.fixture
def fast_server(tokenizer) -> Iterator[str]:
    """The pages over a scripted reader that sees stairs ahead, obstacle on the left, in milliseconds
    (the tiny model takes seconds a frame on a busy machine: every answer would be past the limit)."""
    with live_server(create_app(Settings(), SlowReader(tokenizer))) as url:
        yield url


# ------------------------------------------------------------------ cues, with a scripted socket


def test_a_change_is_said_once_danger_interrupts_and_buzzes_mute_silences(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=60000")
    stream = ScriptedStream(page)
    page.tap("#toggle")
    assert log(page)["fullscreen"] == 1 and log(page)["locks"] == 1
    assert page.get_attribute("#banner", "data-stale-ms") == "60000"

    stream.wait_frames(1)
    answer(stream, "danger: stairs")
    wait_frames(page, 1)
    assert banner(page) == "danger: stairs"
    assert log(page)["said"] == [{"text": "stairs ahead", "lang": "en"}]  # the page language
    assert log(page)["buzz"] == [DANGER_BUZZ]
    cancels = log(page)["cancels"]
    assert cancels >= 1  # a danger cuts off anything being said
    screenshot(page, "walk-aid-danger")

    # The same label again: nothing new said or felt.
    stream.wait_frames(2)
    answer(stream, "danger: stairs")
    wait_frames(page, 2)
    assert said(page) == ["stairs ahead"] and len(log(page)["buzz"]) == 1

    # A change is said at once, with the obstacle's side.
    stream.wait_frames(3)
    answer(stream, "danger: wall ahead", side="left")
    wait_frames(page, 3)
    assert said(page) == ["stairs ahead", "wall ahead, obstacle on the left"]
    assert log(page)["buzz"] == [DANGER_BUZZ, DANGER_BUZZ]

    # A door is said without cutting off anything and without a buzz.
    stream.wait_frames(4)
    cancels = log(page)["cancels"]
    answer(stream, "door ahead")
    wait_frames(page, 4)
    assert said(page)[-1] == "door ahead" and log(page)["cancels"] == cancels and len(log(page)["buzz"]) == 2

    # "clear" only once the path has stayed clear for a moment (0.8 s): the first clear frame says nothing.
    stream.wait_frames(5)
    answer(stream, "all clear ahead")
    wait_frames(page, 5)
    assert banner(page) == "all clear ahead" and said(page)[-1] == "door ahead"
    page.wait_for_timeout(900)
    stream.wait_frames(6)
    answer(stream, "all clear ahead")
    wait_frames(page, 6)
    assert said(page)[-1] == "clear"
    stream.wait_frames(7)
    answer(stream, "all clear ahead")
    wait_frames(page, 7)
    assert said(page).count("clear") == 1

    # The voice follows the page language.
    page.evaluate("document.documentElement.lang = 'de'")
    stream.wait_frames(8)
    answer(stream, "danger: pet ahead")
    wait_frames(page, 8)
    assert log(page)["said"][-1] == {"text": "animal ahead", "lang": "de"}

    # Mute: speech stops at once and stays off; the buzz stays (it is not sound).
    assert page.text_content("#mute") == "voice on"
    page.tap("#mute")
    assert page.text_content("#mute") == "voice off" and page.get_attribute("#mute", "aria-pressed") == "true"
    assert log(page)["cancels"] > cancels
    count = len(said(page))
    stream.wait_frames(9)
    answer(stream, "danger: stairs")
    wait_frames(page, 9)
    assert banner(page) == "danger: stairs" and len(said(page)) == count
    assert log(page)["buzz"][-1] == DANGER_BUZZ

    # Stop releases the screen lock and leaves full screen.
    page.tap("#toggle")
    assert banner(page) == "stopped"
    page.wait_for_function("() => window.__walk.releases === 1")

    # The mute choice is remembered on this phone.
    page.reload()
    assert page.text_content("#mute") == "voice off"
    page.tap("#mute")
    assert page.text_content("#mute") == "voice on" and page.evaluate("localStorage.getItem('djev_walk_muted')") is None
    assert page.errors == []


def test_answers_past_the_limit_and_a_dropped_socket_are_no_answer(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=1000")
    stream = ScriptedStream(page)
    page.tap("#toggle")
    stream.wait_frames(1)
    answer(stream, "all clear ahead")
    wait_frames(page, 1)
    assert banner(page) == "all clear ahead"
    assert page.is_visible("#age") and page.text_content("#age").endswith(" s")
    meta = page.text_content("#meta")
    assert meta.startswith("80% · ") and meta.endswith(" ms")
    assert int(meta.split(" · ")[1].removesuffix(" ms")) < 1000  # capture to answer

    # No further answer: within the limit (plus a tick) the label gives way to "no answer".
    stream.wait_frames(2)
    started = time.monotonic()
    wait_banner(page, NO_ANSWER, timeout_ms=3000)
    assert time.monotonic() - started < 1.6
    assert "stale" in page.get_attribute("#age", "class") and not page.is_visible("#arrow")
    wait_said(page, "no answer, stop")
    assert log(page)["buzz"][-1] == NO_ANSWER_BUZZ
    screenshot(page, "walk-aid-no-answer")

    # The late answer arrives older than the limit: it is not shown, and the page says why.
    answer(stream, "danger: stairs")
    wait_frames(page, 2)
    assert banner(page) == NO_ANSWER
    assert page.text_content("#status").startswith("answers are too slow to walk with")
    assert page.text_content("#meta").startswith("too slow · ")
    assert said(page).count("answers are too slow to walk with") == 1
    assert "danger: stairs" not in log(page)["banners"]

    # A fresh answer clears the guard, and what is ahead is said again.
    stream.wait_frames(3)
    answer(stream, "danger: stairs")
    wait_frames(page, 3)
    shown(page, "danger: stairs")  # (on a busy machine it may since have aged past the limit again)
    assert said(page)[-1] in ("stairs ahead", "no answer, stop") and "stairs ahead" in said(page)

    # A dropped socket is "no answer" at once, until the reconnected socket answers.
    stream.wait_frames(4)
    stream.route.close(code=1011, reason="gone")
    wait_banner(page, NO_ANSWER, timeout_ms=500)
    stream.wait_frames(5)
    assert stream.connections == 2
    answer(stream, "door ahead")
    wait_frames(page, 4)
    shown(page, "door ahead")

    # A server that answers every frame with an error: the next frame goes out at once, and the
    # label gives way to "no answer" within the limit.
    started = time.monotonic()
    errors_sent = 0
    while banner(page) != NO_ANSWER:
        assert time.monotonic() - started < 1.6, "the label outlived the limit"
        stream.wait_frames(6 + errors_sent)  # the page sends the next frame once this one is answered
        stream.answer({"type": "error", "status": 502, "error": {"message": "engine failed: boom", "type": "x",
                                                                 "param": None}})
        errors_sent += 1
    assert errors_sent >= 1
    assert page.text_content("#status") == "error: engine failed: boom"
    assert page.errors == []


def test_thinking_too_slow_keeps_the_guard(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=300")
    stream = ScriptedStream(page)
    page.check("#think")
    page.tap("#toggle")
    stream.wait_frames(1)
    page.wait_for_timeout(450)
    answer(stream, "all clear ahead")
    wait_frames(page, 1)
    assert banner(page) == NO_ANSWER and "all clear ahead" not in log(page)["banners"]
    status = page.text_content("#status")
    assert status.startswith("answers are too slow to walk with; turn thinking off (") and "limit 300 ms" in status, status
    assert "answers are too slow to walk with; turn thinking off" in said(page)
    assert page.get_attribute("#banner", "data-slow") == "1"
    screenshot(page, "walk-aid-too-slow-thinking")


def test_screen_lock_comes_back_after_the_page_was_hidden(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=60000")
    page.tap("#toggle")
    wait_frames(page, 1)
    assert log(page)["locks"] == 1
    page.evaluate("window.__walkHide(true)")
    assert page.text_content("#status") == "paused while the page is hidden"
    assert banner(page) == "paused" and not page.is_visible("#arrow") and not page.is_visible("#age")
    assert page.evaluate("document.getElementById('video').srcObject") is None  # the camera is off
    page.evaluate("window.__walkHide(false)")
    page.wait_for_function("() => window.__walk.locks === 2")
    count = int(page.get_attribute("#banner", "data-frames"))
    wait_frames(page, count + 1)
    assert banner(page) in LABELS
    page.tap("#toggle")
    page.wait_for_function("() => window.__walk.releases >= 1")
    assert page.errors == []


def test_a_camera_that_stops_is_no_answer(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=60000")
    page.tap("#toggle")
    wait_frames(page, 1)
    page.evaluate("document.getElementById('video').srcObject.getVideoTracks()[0].stop()")
    wait_banner(page, NO_ANSWER, timeout_ms=2000)
    assert page.text_content("#status") == "error: the camera stopped; press Start"
    assert page.text_content("#toggle") == "Start"
    wait_said(page, "no answer, stop")
    page.wait_for_function("() => window.__walk.releases >= 1")
    assert page.errors == []


def test_without_speech_the_page_says_so_once(fast_server, page_factory):
    page = open_walk(page_factory, fast_server, "?stale_ms=60000", no_speech=True)
    assert page.text_content("#mute") == "no voice" and page.is_disabled("#mute")
    page.tap("#toggle")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('no speech in this')")
    wait_frames(page, 1)
    page.tap("#toggle")
    page.tap("#toggle")
    wait_frames(page, 1)
    page.wait_for_timeout(300)
    assert not page.text_content("#status").startswith("no speech")
    assert page.errors == []


# ------------------------------------------------------------------ the stale guard against a real server


class SlowReader(ScriptedReader):
    """The scripted reader seeing stairs ahead with the obstacle on the left, `delay` seconds per read."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, conf=0.9, pick=lambda spec, slot: 1 if len(spec.label_ids[slot]) == 6 else 0)
        self.delay = 0.0

    async def read(self, specs):
        await asyncio.sleep(self.delay)
        return await super().read(specs)


def test_a_slow_server_is_no_answer_until_it_is_fast_again(tokenizer, page_factory):
    reader = SlowReader(tokenizer)
    with live_server(create_app(Settings(), reader)) as url:
        page = open_walk(page_factory, url)  # the default limit
        assert page.get_attribute("#banner", "data-stale-ms") == "1500"
        page.tap("#toggle")
        wait_frames(page, 1)
        wait_banner(page, "danger: stairs")
        wait_said(page, "stairs ahead, obstacle on the left")

        reader.delay = 2.5
        started = time.monotonic()
        wait_banner(page, NO_ANSWER, timeout_ms=4000)
        assert time.monotonic() - started < 2.0  # the limit, from the last answer's capture
        page.evaluate("window.__walk.banners = []")
        wait_said(page, "no answer, stop")
        assert log(page)["buzz"][-1] == NO_ANSWER_BUZZ
        page.wait_for_function("() => Number(document.getElementById('banner').dataset.slow) >= 1", timeout=8000)
        assert banner(page) == NO_ANSWER and "danger: stairs" not in log(page)["banners"]
        screenshot(page, "walk-aid-slow-server")

        reader.delay = 0.0
        wait_banner(page, "danger: stairs", timeout_ms=8000)
        assert said(page)[-1] == "stairs ahead, obstacle on the left"
        page.tap("#toggle")
        assert page.errors == []


@contextlib.contextmanager
def scripted_server(tokenizer, port: int):
    reader = ScriptedReader(tokenizer, conf=0.9, pick=lambda spec, slot: 2 if len(spec.label_ids[slot]) == 6 else 1)
    with live_server(create_app(Settings(), reader), port=port) as url:
        yield url


def test_a_stopped_server_is_no_answer_and_a_restarted_one_clears_it(tokenizer, page_factory):
    port = free_port()
    with scripted_server(tokenizer, port) as url:
        page = open_walk(page_factory, url)
        page.tap("#toggle")
        wait_banner(page, "danger: wall ahead")
    # The server is gone: no answer, said, while the page keeps trying to reconnect.
    wait_banner(page, NO_ANSWER, timeout_ms=2000)
    page.evaluate("window.__walk.banners = []")
    wait_said(page, "no answer, stop")
    page.wait_for_timeout(1500)
    assert banner(page) == NO_ANSWER and "danger: wall ahead" not in log(page)["banners"]
    assert "reconnecting" in page.text_content("#status")
    screenshot(page, "walk-aid-server-stopped")
    with scripted_server(tokenizer, port):
        wait_banner(page, "danger: wall ahead", timeout_ms=10_000)
        assert said(page)[-1] == "wall ahead, obstacle on the right"
        screenshot(page, "walk-aid-server-back")
        page.tap("#toggle")
    assert page.errors == []


def test_the_limit_override_ignores_nonsense(fast_server, page_factory):
    page = open_walk(page_factory, fast_server)
    for query, limit in (("?stale_ms=abc", "1500"), ("?stale_ms=-5", "1500"), ("?stale_ms=0", "1500"),
                         ("?stale_ms=250", "250")):
        page.goto(f"{fast_server}/walk{query}")
        assert page.get_attribute("#banner", "data-stale-ms") == limit, query
