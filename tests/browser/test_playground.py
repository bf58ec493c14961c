"""The playground page (/) in headless chromium against the live tiny-model server: REST sends,
#req= autoload, skipped answers, webcam one-shot over REST and realtime over the websocket."""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

from tests.browser.conftest import screenshot

TIMEOUT_MS = 30_000

SKIPPING = {
    "model": "jev-latest",
    "state": {"ticket": "The invoice total is wrong."},
    "questions": {
        "q": {"type": "noul", "instructions": "Is this about money?"},
        # Exactly one of these two is asked, whatever q's answer is.
        "if_no": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "support": None},
                  "ask_if": {"q": ["no"]}},
        "if_yes": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"],
                   "ask_if": {"q": ["yes"]}},
    },
}


# Delays every camera start by this long, so a click right after choosing a webcam mode always
# lands while the camera is still starting (a fast fake camera may win the race otherwise).
SLOW_CAMERA = """(() => {
  const devices = navigator.mediaDevices;
  const getUserMedia = devices.getUserMedia.bind(devices);
  devices.getUserMedia = (constraints) =>
    new Promise((resolve) => setTimeout(resolve, %d)).then(() => getUserMedia(constraints));
})()"""


def open_playground(page_factory, url: str, fragment: str = "", camera_delay_ms: int = 0):
    page = page_factory()
    if camera_delay_ms:
        page.add_init_script(SLOW_CAMERA % camera_delay_ms)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/{fragment}")
    page.set_default_timeout(TIMEOUT_MS)
    page.errors = errors
    return page


def rows(page) -> list[list[str]]:
    return page.eval_on_selector_all(
        "#answers tbody tr", "trs => trs.map(tr => [...tr.cells].map(td => td.textContent))"
    )


def wait_rows(page, count: int) -> list[list[str]]:
    page.wait_for_function(f"() => document.querySelectorAll('#answers tbody tr').length === {count}", timeout=TIMEOUT_MS)
    return rows(page)


def test_renders_and_sends_the_default_example(page_server, page_factory):
    page = open_playground(page_factory, page_server)
    assert page.title() == "djev playground"
    assert page.inner_text("h1") == "djev playground"
    assert "djev-tiny-random" in page.inner_text("#served")
    assert page.is_visible("#tiny-banner") and "random" in page.inner_text("#tiny-banner")
    request = json.loads(page.input_value("#request"))
    assert list(request["questions"]) == ["urgent", "team", "tone"]
    assert page.input_value("#request").startswith('{\n  "model": "jev-latest"')
    assert page.input_value("#seed") == "42"
    assert page.eval_on_selector_all("#mode option", "os => os.map(o => o.value)") == [
        "none", "file", "oneshot", "live", "realtime"]
    assert page.get_attribute("#raw-box", "open") is not None

    page.click("#send")
    table = wait_rows(page, 3)
    assert [row[0] for row in table] == ["urgent", "team", "tone"]
    assert [row[1] for row in table] == ["noul", "choice", "score"]
    answer, p = table[0][2].split(" (p=")
    assert answer in ("yes", "no") and p.endswith(")") and 0 <= float(p[:-1]) <= 1
    assert table[1][2] in ("billing", "outage", "feature")
    assert table[2][2].split(" ")[0] in ("calm", "annoyed", "furious") and "(score " in table[2][2]
    for row in table:
        assert 0.0 <= float(row[3]) <= 1.0 and len(row[3].split(".")[1]) == 2
    meta = page.inner_text("#meta")
    assert "ms round trip" in meta and "ms in the server" in meta and "usage {" in meta and "read" in meta
    assert json.loads(page.inner_text("#raw"))["model"] == "djev-tiny-random"
    assert page.inner_text("#status") == "HTTP 200"
    screenshot(page, "playground-default")
    assert page.errors == []


def test_bad_json_and_http_errors_show_red(page_server, page_factory):
    page = open_playground(page_factory, page_server)
    page.fill("#request", "{not json")
    page.click("#send")
    assert page.inner_text("#status").startswith("request is not JSON:")
    assert "status-error" in page.get_attribute("#status", "class")

    page.fill("#request", json.dumps({"questions": {"x": {"type": "bogus", "instructions": "?"}}}))
    page.click("#send")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('HTTP 4')")
    assert "status-error" in page.get_attribute("#status", "class")
    assert page.errors == []


def test_hash_autoload_sends_immediately(page_server, page_factory):
    encoded = base64.b64encode(json.dumps(SKIPPING).encode()).decode()
    page = open_playground(page_factory, page_server, "#req=" + encoded.replace("=", "%3D"))
    table = wait_rows(page, 3)
    assert [row[0] for row in table] == ["q", "if_no", "if_yes"]
    assert json.loads(page.input_value("#request"))["state"] == SKIPPING["state"]
    assert page.input_value("#request").startswith('{\n  "model"')  # pretty-printed
    assert page.errors == []

    bad = open_playground(page_factory, page_server, "#req=%%%not-base64")
    bad.wait_for_function("() => document.getElementById('status').textContent.startsWith('bad #req: ')")
    assert "status-error" in bad.get_attribute("#status", "class")


def test_skipped_answers_render_as_skipped(page_server, page_factory):
    page = open_playground(page_factory, page_server)
    page.fill("#request", json.dumps(SKIPPING, indent=2))
    page.press("#request", "Control+Enter")  # the keyboard shortcut sends
    table = wait_rows(page, 3)
    skipped = [row for row in table if row[2].startswith("skipped")]
    asked = [row for row in table if not row[2].startswith("skipped")]
    assert len(skipped) == 1 and skipped[0][0] in ("if_no", "if_yes")
    assert "q was" in skipped[0][2] and skipped[0][3] == ""
    assert skipped[0][1] == ("choice" if skipped[0][0] == "if_no" else "score")  # from the request
    assert len(asked) == 2 and asked[0][0] == "q"
    screenshot(page, "playground-skipped")
    assert page.errors == []


def test_webcam_one_shot_posts_a_frame(page_server, page_factory):
    page = open_playground(page_factory, page_server)
    page.select_option("#mode", "oneshot")
    page.wait_for_function("() => document.getElementById('status').textContent === 'camera on'")
    assert page.is_visible("#video") and page.is_visible("#capture")
    assert not page.is_visible("#live-toggle") and not page.is_visible("#rt-toggle")
    # The ticket example was swapped for the image example when the webcam mode was chosen.
    assert list(json.loads(page.input_value("#request"))["questions"]) == ["scene", "hand"]
    page.click("#capture")
    table = wait_rows(page, 2)
    assert [row[0] for row in table] == ["scene", "hand"]
    assert page.is_visible("#preview")
    page.select_option("#mode", "none")
    assert not page.is_visible("#video") and not page.is_visible("#preview")
    assert page.errors == []


def test_image_file_mode_posts_the_file(page_server, page_factory):
    image = io.BytesIO()
    Image.new("RGB", (96, 64), (40, 120, 200)).save(image, "JPEG")
    page = open_playground(page_factory, page_server)
    page.select_option("#mode", "file")
    assert page.is_visible("#file") and not page.is_visible("#capture")
    page.set_input_files("#file", files=[{"name": "blue.jpg", "mimeType": "image/jpeg", "buffer": image.getvalue()}])
    assert page.is_visible("#preview")
    with page.expect_request("**/v1/systemone") as request_info:
        page.click("#send")
    assert request_info.value.headers["content-type"].startswith("multipart/form-data")
    assert [row[0] for row in wait_rows(page, 3)] == ["urgent", "team", "tone"]
    assert page.inner_text("#status") == "HTTP 200"
    assert page.errors == []


def test_realtime_streams_frames_over_the_websocket(page_server, page_factory):
    page = open_playground(page_factory, page_server)
    ws_urls: list[str] = []
    page.on("websocket", lambda ws: ws_urls.append(ws.url))
    page.select_option("#mode", "realtime")
    page.wait_for_function("() => document.getElementById('status').textContent === 'camera on'")
    page.click("#rt-toggle")
    page.wait_for_function(
        "() => { const c = document.getElementById('rt-count').dataset;"
        " return Number(c.decided) >= 4 && Number(c.sent) > 3; }",
        timeout=TIMEOUT_MS,
    )
    assert ws_urls and ws_urls[0].startswith("ws://") and ws_urls[0].endswith("/v1/stream")
    counter = page.inner_text("#rt-count")
    assert " sent · " in counter and " decided, " in counter and counter.endswith(" dropped")
    assert page.inner_text("#rt-toggle") == "Stop"
    table = rows(page)
    assert [row[0] for row in table] == ["scene", "hand"]
    first = page.inner_text("#raw")
    page.wait_for_function(f"() => document.getElementById('raw').textContent !== {json.dumps(first)}")
    assert json.loads(page.inner_text("#raw"))["type"] == "result"
    assert "ms round trip" in page.inner_text("#meta")
    screenshot(page, "playground-realtime")

    page.click("#rt-toggle")
    sent = int(page.get_attribute("#rt-count", "data-sent"))
    page.wait_for_timeout(400)
    assert int(page.get_attribute("#rt-count", "data-sent")) == sent  # stopped
    assert page.inner_text("#rt-toggle") == "Start"
    assert page.errors == []


def textarea_ids(page) -> list[str]:
    return list(json.loads(page.input_value("#request"))["questions"])


def record_configs(page) -> list[list[str]]:
    """The question ids of every config message the page sends over a /v1/stream websocket."""
    configs: list[list[str]] = []

    def on_frame(payload) -> None:
        message = json.loads(payload) if isinstance(payload, str) else None
        if isinstance(message, dict) and message.get("type") == "config":
            configs.append(list(message["request"]["questions"]))

    page.on("websocket", lambda ws: ws.on("framesent", on_frame))
    return configs


def wait_decided(page, at_least: int) -> None:
    page.wait_for_function(
        f"() => Number(document.getElementById('rt-count').dataset.decided) >= {at_least}", timeout=TIMEOUT_MS)


def test_realtime_started_at_once_answers_the_request_on_screen(page_server, page_factory):
    # Start clicked while the camera is still starting: the camera example it swaps in is what the
    # session is configured with, not the ticket example the textarea held at the click.
    page = open_playground(page_factory, page_server, camera_delay_ms=1000)
    configs = record_configs(page)
    page.select_option("#mode", "realtime")
    page.click("#rt-toggle")
    wait_decided(page, 3)
    assert textarea_ids(page) == ["scene", "hand"]
    assert [row[0] for row in rows(page)] == textarea_ids(page)
    assert configs and all(ids == textarea_ids(page) for ids in configs)
    page.click("#rt-toggle")
    assert page.inner_text("#rt-toggle") == "Start"
    assert page.errors == []


def test_send_at_once_in_a_webcam_mode_answers_the_request_on_screen(page_server, page_factory):
    # Send clicked while the camera is still starting sends the camera example the textarea shows.
    page = open_playground(page_factory, page_server, camera_delay_ms=1000)
    page.select_option("#mode", "oneshot")
    page.click("#send")
    page.wait_for_function("() => document.querySelectorAll('#answers tbody tr').length > 0"
                           " && document.getElementById('video').hidden === false")
    assert textarea_ids(page) == ["scene", "hand"]
    assert [row[0] for row in rows(page)] == textarea_ids(page)
    assert page.errors == []


def test_a_new_request_while_realtime_runs_reconfigures_it(page_server, page_factory):
    # A #req= link opened while realtime runs replaces the textarea without an input event: the
    # running session takes the new request up too.
    page = open_playground(page_factory, page_server)
    configs = record_configs(page)
    page.select_option("#mode", "realtime")
    page.wait_for_function("() => document.getElementById('status').textContent === 'camera on'")
    page.click("#rt-toggle")
    wait_decided(page, 2)
    assert [row[0] for row in rows(page)] == ["scene", "hand"]

    encoded = base64.b64encode(json.dumps(SKIPPING).encode()).decode()
    page.evaluate(f"location.hash = {json.dumps('#req=' + encoded)}")
    page.wait_for_function(f"() => document.getElementById('request').value.includes({json.dumps(SKIPPING['state']['ticket'])})")
    decided = int(page.get_attribute("#rt-count", "data-decided"))
    # Past the frame that was in flight at the change, and showing a realtime result (not the REST one).
    page.wait_for_function(
        f"() => Number(document.getElementById('rt-count').dataset.decided) >= {decided + 3}"
        " && document.getElementById('raw').textContent.includes('\"type\": \"result\"')",
        timeout=TIMEOUT_MS,
    )
    assert textarea_ids(page) == list(SKIPPING["questions"])
    assert [row[0] for row in rows(page)] == textarea_ids(page)
    assert configs[-1] == textarea_ids(page)
    page.click("#rt-toggle")
    assert page.inner_text("#rt-toggle") == "Start"
    assert page.errors == []
