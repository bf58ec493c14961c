"""Record the Cube Rule page's replay: every food photo through a djev server, written to
app/static/cube/replay.json.

The request is the page's own: it is read from app/static/js/cube.js (the JSON between the
`request-json` markers), so the replay asks exactly what a live run asks (seed 7, one sample).

    .venv/bin/python scripts/record_cube_replay.py                    # in-process tiny model
    .venv/bin/python scripts/record_cube_replay.py --url http://127.0.0.1:8011 [--api-key KEY]

Without --url the script builds the tiny random-weight checkpoint in a temporary folder and serves
it in-process (the same app the server runs): its answers are random, and replay.json says which
model recorded it, as does the page. With --url it asks that server (model, engine and device come
from its /health).

replay.json: {"recorded": {"model", "engine", "device", "date", "seed"},
              "foods": {name: {"cube": {category: p (4 decimals)}, "ms": int}}}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CUBE = ROOT / "app" / "static" / "cube"
PAGE_JS = ROOT / "app" / "static" / "js" / "cube.js"
CATEGORIES = ("toast", "sandwich", "taco", "sushi", "quiche", "calzone", "salad", "soup")


def page_request(path: Path = PAGE_JS) -> dict:
    """The request body the page sends, from the strict JSON between the markers in cube.js."""
    match = re.search(r"/\* request-json \*/(.*?)/\* end-request-json \*/", path.read_text(), re.S)
    if not match:
        raise SystemExit(f"{path}: no /* request-json */ ... /* end-request-json */ block")
    request = json.loads(match.group(1))
    criteria = request["questions"]["cube"]["criteria"]
    if tuple(criteria) != CATEGORIES:
        raise SystemExit(f"{path}: the cube criteria are {list(criteria)}, expected {list(CATEGORIES)}")
    return request


@contextmanager
def tiny_server() -> Iterator[str]:
    """The tiny model, served in-process on 127.0.0.1 (the tests' set-up, without pytest)."""
    from app.build import hf_options
    from app.config import Settings
    from app.engine.hf.loader import load_hf_reader
    from app.engine.tiny import TINY_MODEL_NAME, write_tiny_model
    from app.server import create_app, serve_in_background

    with tempfile.TemporaryDirectory(prefix="djev-tiny-") as folder:
        checkpoint = write_tiny_model(Path(folder) / "model")
        reader = load_hf_reader(checkpoint, hf_options(Settings.of(device="cpu"), TINY_MODEL_NAME, tiny=True))
        with serve_in_background(create_app(Settings(), reader)) as url:
            yield url


def record(url: str, api_key: str = "", only: list[str] | None = None) -> dict:
    import httpx

    request = page_request()
    foods = json.loads((CUBE / "foods.json").read_text())
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        health = client.get("/health").json()
        if health.get("status") != "ok":
            raise SystemExit(f"{url}/health: {health}")
        client.post("/v1/systemone", json={**request, "questions": {"warm": {"type": "noul"}}, "state": "warm up"})
        results: dict[str, dict] = {}
        for food in foods:
            if only and food["name"] not in only:
                continue
            photo = (CUBE / food["file"]).read_bytes()
            started = time.perf_counter()
            response = client.post("/v1/systemone", data={"request": json.dumps(request)},
                                   files={"photo": ("a.jpg", photo, "image/jpeg")})
            ms = round((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"{food['name']}: HTTP {response.status_code}: {response.text[:300]}")
            answer = response.json()["answers"]["cube"]
            cube = {name: round(float(answer["probabilities"][name]), 4) for name in CATEGORIES}
            results[food["name"]] = {"cube": cube, "ms": ms}
            top = max(cube, key=cube.get)
            print(f"{food['name']:16} {top:9} {cube[top]:.4f} {ms:5d} ms (expected {food['category']})")
    return {
        "recorded": {
            "model": health.get("model", "?"),
            "engine": health.get("engine", "?"),
            "device": health.get("device", "?"),
            "date": dt.date.today().isoformat(),
            "seed": request["seed"],
        },
        "foods": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running djev server (default: the tiny model in-process)")
    parser.add_argument("--api-key", default="", help="bearer token for a server started with API_KEY")
    parser.add_argument("--out", type=Path, default=CUBE / "replay.json")
    args = parser.parse_args(argv)
    if args.url:
        replay = record(args.url.rstrip("/"), args.api_key)
    else:
        with tiny_server() as url:
            replay = record(url)
    args.out.write_text(json.dumps(replay, indent=1, ensure_ascii=False) + "\n")
    hits = sum(1 for food in json.loads((CUBE / "foods.json").read_text())
               if max(replay["foods"][food["name"]]["cube"].items(), key=lambda kv: kv[1])[0] == food["category"])
    print(f"wrote {args.out} ({len(replay['foods'])} foods, {hits} in the expected category) "
          f"recorded on {replay['recorded']['model']} ({replay['recorded']['engine']}, {replay['recorded']['device']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
