"""The Cube Rule page (/cube) in Debian's chromium: live runs on the tiny model, the recorded replay,
cards sorted by probability, the user's own photos; and the page's data files."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from tests.browser.conftest import screenshot

ROOT = Path(__file__).resolve().parents[2]
CUBE = ROOT / "app" / "static" / "cube"
CATEGORIES = ["toast", "sandwich", "taco", "sushi", "quiche", "calzone", "salad", "soup"]
SIDES = ["1 side, bottom", "2 sides, top and bottom", "3 sides, bottom and two walls", "4 sides, wrapped",
         "5 sides, open top", "6 sides, enclosed", "no starch", "no starch, liquid"]
RUN_TIMEOUT_MS = 90_000  # 27 reads of the tiny model on two CPU cores, beside chromium
TALL = {"width": 1280, "height": 1400}  # the whole board in a screenshot

BOARD = """() => {
  const rows = [...document.querySelectorAll('.rows .row')].map((row) => ({
    category: row.dataset.category,
    count: Number(row.querySelector('.count').textContent),
    cards: [...row.querySelectorAll('.track .card')].map((card) => ({name: card.dataset.name, p: Number(card.dataset.p),
                                                                     pct: card.querySelector('.pct').textContent})),
  }));
  return {rows, pool: document.querySelectorAll('#pool .card').length,
          state: document.getElementById('cube').dataset.state,
          status: document.getElementById('status').textContent};
}"""

ALL_PLACED = """(n) => {
  const placed = [...document.querySelectorAll('.rows .row .count')].reduce((s, c) => s + Number(c.textContent), 0);
  return placed === n && document.querySelectorAll('#pool .card').length === 0
         && document.getElementById('cube').dataset.state === 'done';
}"""


def foods() -> list[dict]:
    return json.loads((CUBE / "foods.json").read_text())


def assert_all_placed(board: dict, total: int = 27) -> None:
    assert [row["category"] for row in board["rows"]] == CATEGORIES
    assert sum(row["count"] for row in board["rows"]) == total
    assert all(row["count"] == len(row["cards"]) for row in board["rows"])
    assert board["pool"] == 0
    names = sorted(card["name"] for row in board["rows"] for card in row["cards"])
    assert names == sorted(food["name"] for food in foods())


def assert_sorted(board: dict) -> None:
    for row in board["rows"]:
        ps = [card["p"] for card in row["cards"]]
        assert ps == sorted(ps, reverse=True), (row["category"], ps)
        assert all(0 <= p <= 1 for p in ps)
        assert all(card["pct"] == f"{math.floor(card['p'] * 100 + 0.5)}%" for card in row["cards"])  # JS Math.round


def png_photo(color=(200, 120, 40)) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (640, 480), (235, 230, 220))
    draw = ImageDraw.Draw(image)
    draw.ellipse([120, 60, 520, 420], fill=(250, 250, 250), outline=(180, 180, 180), width=8)
    draw.rectangle([220, 170, 420, 310], fill=color)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# ---- the data files ---------------------------------------------------------------------------------

def test_foods_cover_every_category_with_small_jpegs():
    listed = foods()
    assert len(listed) == 27
    assert len({food["name"] for food in listed}) == 27
    assert {food["category"] for food in listed} == set(CATEGORIES)
    for category in CATEGORIES:
        assert sum(food["category"] == category for food in listed) >= 2, category
    for food in listed:
        assert set(food) == {"name", "file", "category", "note"}
        path = CUBE / food["file"]
        assert path.is_file(), path
        data = path.read_bytes()
        assert data[:3] == b"\xff\xd8\xff", f"{path.name} is not a JPEG"
        assert len(data) <= 64 * 1024, f"{path.name}: {len(data)} bytes"
    from PIL import Image

    with Image.open(CUBE / listed[0]["file"]) as image:
        assert image.format == "JPEG" and max(image.size) == 512
    assert (CUBE / "LICENSE.txt").is_file()


def test_replay_covers_every_food():
    replay = json.loads((CUBE / "replay.json").read_text())
    assert set(replay["recorded"]) == {"model", "engine", "device", "date", "seed"}
    assert replay["recorded"]["seed"] == 7
    assert set(replay["foods"]) == {food["name"] for food in foods()}
    for name, entry in replay["foods"].items():
        assert list(entry["cube"]) == CATEGORIES, name
        assert all(0 <= p <= 1 and round(p, 4) == p for p in entry["cube"].values()), name
        assert abs(sum(entry["cube"].values()) - 1) < 0.01, name
        assert isinstance(entry["ms"], int) and entry["ms"] >= 0, name
        assert "top" not in entry  # the page derives the choice from the probabilities


def test_the_recorder_reads_the_pages_exact_question():
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_cube_replay", ROOT / "scripts" / "record_cube_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    request = module.page_request()
    assert request["model"] == "jev-latest" and request["seed"] == 7 and request["samples"] == 1
    assert request["state"] == {"note": "a photo of a food from its encyclopedia page"}
    cube = request["questions"]["cube"]
    assert list(request["questions"]) == ["cube"] and cube["type"] == "choice"
    assert cube["instructions"] == ("Under the Cube Rule of food identification, a food's category depends only on "
                                    "where its structural starch sits. Which category is the food in the photo?")
    assert list(cube["criteria"]) == CATEGORIES
    assert cube["criteria"]["soup"] == ("no structural starch either, and the food is liquid, served in a bowl or a cup "
                                        "(soup, stew, ramen, a drink)")


# ---- the page ---------------------------------------------------------------------------------------

def open_cube(page_factory, url: str, *, health_fails: bool = False, **context):
    page = page_factory(**context)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    external: list[str] = []
    page.on("request", lambda request: external.append(request.url)
            if not request.url.startswith((url, "data:", "blob:")) else None)
    if health_fails:
        page.route("**/health", lambda route: route.abort())
    page.goto(f"{url}/cube")
    page.errors = errors
    page.external = external
    return page


def test_structure_and_live_run_places_every_card(page_factory, page_server):
    page = open_cube(page_factory, page_server, viewport=TALL)
    assert page.locator("h1").text_content() == "Cube Rule Live"
    heads = page.locator(".row-head .sides").all_text_contents()
    assert heads == SIDES
    page.wait_for_function(
        "() => document.querySelectorAll('#pool .card').length + document.querySelectorAll('.rows .card').length === 27")
    page.wait_for_function("() => document.getElementById('cube').dataset.state === 'live'", timeout=15_000)
    assert page.locator("#run-live").is_disabled() and page.locator("#replay").is_disabled()
    page.wait_for_function(ALL_PLACED, arg=27, timeout=RUN_TIMEOUT_MS)
    page.wait_for_timeout(1200)  # the last flight and the tracks scrolling back
    board = page.evaluate(BOARD)
    assert_all_placed(board)
    assert_sorted(board)
    assert page.locator("#pool.empty").count() == 1
    assert page.locator("#run-live").is_enabled() and page.locator("#replay").is_enabled()
    assert page.get_attribute("#run-live", "title") != "needs the djev server"
    assert "done: 27 placed" in board["status"]
    assert page.locator(".fly-layer .card").count() == 0
    first = page.locator(".rows .card").first
    assert first.get_attribute("href").startswith("/static/cube/") and first.get_attribute("target") == "_blank"
    box = first.bounding_box()
    assert round(box["width"]) == 92 and round(box["height"]) == 92
    screenshot(page, "cube-live")
    assert page.errors == [] and page.external == []


def test_replay_starts_when_health_fails_and_places_every_card(page_factory, page_server):
    page = open_cube(page_factory, page_server, health_fails=True, viewport=TALL)
    page.wait_for_function("() => document.getElementById('cube').dataset.state === 'replay'", timeout=15_000)
    assert page.locator("#run-live").is_disabled()
    assert page.get_attribute("#run-live", "title") == "needs the djev server"
    page.wait_for_function("() => document.getElementById('status').textContent.includes('(replay)')")
    page.wait_for_timeout(2000)
    screenshot(page, "cube-replay-running")
    page.wait_for_function(ALL_PLACED, arg=27, timeout=RUN_TIMEOUT_MS)
    page.wait_for_timeout(1200)
    board = page.evaluate(BOARD)
    assert_all_placed(board)
    assert_sorted(board)
    # each card sits in the row of its highest recorded probability, showing that probability
    replay = json.loads((CUBE / "replay.json").read_text())["foods"]
    for row in board["rows"]:
        for card in row["cards"]:
            cube = replay[card["name"]]["cube"]
            assert max(cube, key=cube.get) == row["category"]
            assert card["p"] == cube[row["category"]]
    recorded = page.locator("#recorded").text_content()
    assert "djev-tiny-random" in recorded and "random" in recorded
    assert "done: 27 placed (replay)" in board["status"]
    screenshot(page, "cube-replay")

    # Reset rebuilds the board; Replay runs again from the button
    page.click("#reset")
    board = page.evaluate(BOARD)
    assert board["pool"] == 27 and sum(row["count"] for row in board["rows"]) == 0
    assert board["state"] == "idle"
    page.click("#replay")
    page.wait_for_function("() => document.querySelectorAll('.rows .card').length >= 2", timeout=15_000)
    page.click("#reset")
    assert page.evaluate(BOARD)["pool"] == 27
    assert page.errors == [] and page.external == []


def test_narrow_dark_reduced_motion_replay(page_factory, page_server):
    page = open_cube(page_factory, page_server, health_fails=True, viewport={"width": 390, "height": 844},
                     color_scheme="dark", reduced_motion="reduce")
    page.wait_for_function(ALL_PLACED, arg=27, timeout=RUN_TIMEOUT_MS)
    board = page.evaluate(BOARD)
    assert_all_placed(board)
    assert_sorted(board)
    # the row header stacks above its track
    head = page.locator(".row").first.locator(".row-head").bounding_box()
    track = page.locator(".row").first.locator(".track").bounding_box()
    assert track["y"] >= head["y"] + head["height"] - 1
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(19, 20, 24)"
    page.locator('.row[data-category="soup"]').scroll_into_view_if_needed()
    screenshot(page, "cube-narrow-dark")
    assert page.errors == []


def test_cards_in_a_row_are_sorted_highest_first(page_factory, page_server):
    """A recorded run with varied probabilities (routed in place of replay.json): each row sorted."""
    names = [food["name"] for food in foods()]
    fake = {"recorded": {"model": "test", "engine": "hf", "device": "cpu", "date": "2026-01-01", "seed": 7}, "foods": {}}
    for index, name in enumerate(names):
        top = CATEGORIES[index % 3]  # three rows of nine
        p = round(0.3 + ((index * 37) % 27) / 40, 4)
        rest = round((1 - p) / 7, 4)
        fake["foods"][name] = {"cube": {c: (p if c == top else rest) for c in CATEGORIES}, "ms": 5}
    page = page_factory(viewport=TALL)
    page.route("**/health", lambda route: route.abort())
    page.route("**/static/cube/replay.json", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps(fake)))
    page.goto(f"{page_server}/cube")
    page.wait_for_function(ALL_PLACED, arg=27, timeout=RUN_TIMEOUT_MS)
    board = page.evaluate(BOARD)
    assert_all_placed(board)
    assert [row["count"] for row in board["rows"]] == [9, 9, 9, 0, 0, 0, 0, 0]
    assert_sorted(board)
    expected = sorted((fake["foods"][n]["cube"]["toast"] for n in names[0::3]), reverse=True)
    assert [card["p"] for card in board["rows"][0]["cards"]] == expected
    # the heat border follows the probability: the first card is hotter than the last
    borders = page.eval_on_selector_all('.row[data-category="toast"] .card',
                                        "cards => cards.map(c => getComputedStyle(c).borderTopColor)")
    assert borders[0] != borders[-1]
    page.wait_for_timeout(1200)
    screenshot(page, "cube-sorted")


def test_a_users_photo_becomes_a_card_and_is_classified_live(page_factory, page_server, tmp_path):
    photo = tmp_path / "my_lunch.png"
    photo.write_bytes(png_photo())
    page = open_cube(page_factory, page_server)
    page.wait_for_function("() => document.getElementById('cube').dataset.state === 'live'", timeout=15_000)
    page.click("#reset")  # stop the automatic run: the photo should not wait for 27 reads
    page.set_input_files("#add-photo", str(photo))
    page.wait_for_selector("#pool .card.user")
    card = page.locator("#pool .card.user")
    assert card.get_attribute("data-name") == "my lunch"
    assert page.locator("#pool .card").first.get_attribute("data-name") == "my lunch"
    assert "Run live reads it" in page.locator("#status").text_content()
    src = card.locator("img").get_attribute("src")
    assert src.startswith("blob:")
    page.click("#run-live")
    page.wait_for_selector(".rows .card.user", timeout=30_000)
    placed = page.locator(".rows .card.user")
    category = placed.evaluate("card => card.closest('.row').dataset.category")
    assert category in CATEGORIES
    assert placed.locator(".pct").text_content().endswith("%")
    status = page.locator("#status").text_content()
    assert status.startswith(("my lunch: ", "reading ")), status
    # a drop onto the pool adds a photo too
    page.evaluate("""async () => {
      const canvas = document.createElement('canvas'); canvas.width = 64; canvas.height = 48;
      const ctx = canvas.getContext('2d'); ctx.fillStyle = '#c84'; ctx.fillRect(0, 0, 64, 48);
      const blob = await new Promise((r) => canvas.toBlob(r, 'image/png'));
      const data = new DataTransfer(); data.items.add(new File([blob], 'dropped soup.png', {type: 'image/png'}));
      document.getElementById('pool-wrap').dispatchEvent(
        new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true}));
    }""")
    page.wait_for_selector('#pool .card.user[data-name="dropped soup"]')
    page.click("#reset")
    # after a reset both of the user's photos are back in the pool, first in line
    names = page.eval_on_selector_all("#pool .card", "cards => cards.map(c => c.dataset.name)")
    assert names[:2] == ["my lunch", "dropped soup"] and len(names) == 29
    screenshot(page, "cube-user-photo")
    assert page.errors == []


def test_a_server_with_an_api_key_waits_for_the_key(page_factory, tiny_dir):
    from app.config import Settings
    from app.server import create_app
    from tests.conftest import live_server, make_tiny_reader

    with live_server(create_app(Settings.of(api_key="cube-key"), make_tiny_reader(tiny_dir))) as url:
        page = open_cube(page_factory, url)
        page.wait_for_function("() => document.getElementById('status').textContent.includes('api key')", timeout=15_000)
        assert page.evaluate(BOARD)["state"] == "idle"  # no automatic run without the key
        assert page.locator("#run-live").is_enabled()
        assert page.get_attribute("#api-key", "placeholder") == "required"
        page.fill("#api-key", "wrong")
        page.dispatch_event("#api-key", "change")
        page.click("#run-live")
        page.wait_for_function("() => document.getElementById('cube').dataset.state === 'error'", timeout=15_000)
        status = page.locator("#status").text_content()
        assert status.startswith("error: HTTP 401"), status
        assert page.locator("#run-live").is_enabled() and page.locator("#replay").is_enabled()
        page.fill("#api-key", "cube-key")
        page.dispatch_event("#api-key", "change")
        page.click("#run-live")
        page.wait_for_function("() => document.querySelectorAll('.rows .card').length >= 1", timeout=30_000)
        page.click("#reset")
        assert page.errors == []
