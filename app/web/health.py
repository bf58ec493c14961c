"""`GET /health`: always open, no token; says which model answers and how loaded the server is.

`status` is one of:

- `starting` (503): the model is loading behind the listener; `phase` is the start-up phase it
  reported last, `done`/`total` its progress, `elapsed_s` the seconds since the load began.
- `failed` (503): the load failed; `reason` says why (the server exits seconds later).
- `ok` (200): ready.
- `degraded` (200): ready, but something failed and the engine serves less well; `reason` says what
  (a CUDA graph capture that failed, so those turns run eagerly; with the remote engine: some upstreams
  are down, each named once with its error). A limit the device sets (the KV store's size, the longest
  state) is configuration, not a fault: it is logged at start and shown here (`max_prompt_tokens`).
- `unavailable` (503): the engine is not running (stopped, or no upstream up: then `reason` names
  each upstream once with its last error).

With the remote engine, `upstreams` lists each one: `{"url", "state": "up"|"down", "last_error"}`
(the bare error; null while up).

`max_prompt_tokens` is the longest state (in tokens) the engine reads: on `hf`, MAX_PROMPT_TOKENS within
what its KV store holds on this device; a longer one is refused at once (400 `max_tokens_exceeded`).

`auth` says whether POST routes and camera sessions require the API key (API_KEY set).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.engine.base import UpstreamReport, upstreams_unavailable
from app.engine.starting import StartingReader
from app.web.errors import json_response
from app.web.services import services


async def health(request: Request) -> Response:
    svc = services(request)
    reader = svc.reader
    info = reader.info
    ready = reader.ready
    status: dict[str, Any]
    if isinstance(reader, StartingReader) and not ready:
        startup = reader.status
        status = {"status": startup.state if startup.state in ("starting", "failed") else "unavailable"}
        status.update(phase=startup.phase, done=startup.done, total=startup.total, elapsed_s=startup.elapsed_s)
        if startup.reason is not None:
            status["reason"] = startup.reason
    elif ready and reader.degraded is not None:
        status = {"status": "degraded", "reason": reader.degraded}
    else:
        status = {"status": "ok" if ready else "unavailable"}
        if not ready and isinstance(reader, UpstreamReport):
            status["reason"] = upstreams_unavailable(reader.upstream_states)
    body = {
        **status,
        "ready": ready,
        "model": info.model,
        "engine": info.engine,
        "device": info.device,
        "tiny": info.tiny,
        "auth": bool(svc.settings.server.api_key),
        "canvas": info.canvas_length,
        "max_prompt_tokens": info.max_prompt_tokens,  # the longest state read (0: not said by the engine)
        "in_flight": svc.admission.in_flight,
        "in_flight_cost": svc.admission.cost,
        "sessions": len(svc.sessions),
        "max_sessions": svc.max_sessions,  # camera sessions open at once (MAX_SESSIONS, or what the engine holds)
        "uptime_s": round(time.time() - svc.started, 1),
        "calibration": svc.calibration.identity() if svc.calibration is not None else None,
    }
    if isinstance(reader, UpstreamReport):
        body["upstreams"] = [state.as_json() for state in reader.upstream_states]
    if info.tiny:
        body["warning"] = "tiny random-weight model: every answer is random"
    return json_response(body, status=200 if ready else 503)


routes = [Route("/health", health, methods=["GET"])]
