"""`djev selftest`: one decision end to end, printed; the exit status says whether it worked.

Against a running server (`--url`, what the Docker image's health check does) the decision goes over
HTTP like any client's. Without a URL the configured engine is built in this process (as `djev
serve` would build it), served on a free local port, and asked the same decision.
"""

from __future__ import annotations

import json
import time
from typing import Any

from app.config import Settings

# The README's example: one question of each type, so every answer path runs.
DECISION: dict[str, Any] = {
    "state": {"ticket": "Everything is down and we have a demo at noon."},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
        "team": {"type": "choice", "instructions": "Which team owns this?",
                 "criteria": {"billing": None, "outage": "service down", "feature": None}},
        "tone": {"type": "score", "instructions": "How angry is the customer?",
                 "criteria": ["calm", "annoyed", "furious"]},
    },
}
EXPECTED_TYPES = {"urgent": "noul", "team": "choice", "tone": "score"}


class SelftestFailure(Exception):
    pass


def check_answer(status: int, body: Any) -> dict:
    """The response's answers, or SelftestFailure saying what is wrong with it."""
    if status != 200:
        raise SelftestFailure(f"HTTP {status}: {json.dumps(body)[:500]}")
    answers = body.get("answers") if isinstance(body, dict) else None
    if not isinstance(answers, dict):
        raise SelftestFailure(f"no answers in the response: {json.dumps(body)[:500]}")
    for name, kind in EXPECTED_TYPES.items():
        answer = answers.get(name)
        if not isinstance(answer, dict) or answer.get("type") != kind:
            raise SelftestFailure(f"answer {name!r} should be a {kind}: {answer!r}")
    return answers


def _post(url: str, settings: Settings, timeout: float) -> tuple[int, Any]:
    import httpx

    headers = {"authorization": f"Bearer {settings.server.api_key}"} if settings.server.api_key else {}
    # verify=False: the image's TLS certificate is self-signed, and the check talks to its own host.
    with httpx.Client(timeout=timeout, verify=False) as client:
        response = client.post(url.rstrip("/") + "/v1/systemone", json=DECISION, headers=headers)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"body": response.text[:500]}


def _in_process(settings: Settings, timeout: float) -> tuple[int, Any, str]:
    from app.build import build_reader
    from app.server import create_app, serve_in_background

    reader = build_reader(settings)
    app = create_app(settings, reader)
    with serve_in_background(app) as url:
        deadline = time.monotonic() + timeout
        while not reader.ready:  # the lifespan starts the reader; vLLM takes a while
            if time.monotonic() > deadline:
                raise SelftestFailure(f"engine {settings.runtime.engine} not ready after {timeout:.0f} s")
            time.sleep(0.2)
        status, body = _post(url, settings, timeout)
    return status, body, f"{settings.runtime.engine} in process"


def run_selftest(settings: Settings, url: str | None, timeout: float) -> int:
    started = time.monotonic()
    try:
        if url:
            status, body = _post(url, settings, timeout)
            where = url
        else:
            status, body, where = _in_process(settings, timeout)
        answers = check_answer(status, body)
    except SelftestFailure as exc:
        print(f"selftest FAILED: {exc}")
        return 1
    except Exception as exc:  # noqa: BLE001 - a refused connection, a timeout, an engine that cannot load
        print(f"selftest FAILED: {type(exc).__name__}: {exc}")
        return 1
    elapsed = time.monotonic() - started
    print(f"selftest ok: {where}, model {body.get('model')}, {elapsed * 1000:.0f} ms")
    for name, answer in answers.items():
        print(f"  {name}: {json.dumps(answer, sort_keys=True)}")
    print(f"  usage: {json.dumps(body.get('usage'))}")
    return 0
