"""`POST /v1/systemone` (and its alias `/v1/decisions`) and `GET /v1/models`, in Jev's shapes.

Parse, decide, serialize: no model logic lives here.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.web.answers import jev_body
from app.web.body import read_raw
from app.web.errors import json_response
from app.web.services import services
from app.web.work import decide, json_reply, options_in, prepare

# Jev's model aliases. Any model id is accepted on a decision; the served model's name is what
# answers.
JEV_ALIASES = (
    ("jev-latest", "Latest stable decision model; answered here by the served DiffusionGemma"),
    ("jev-preview", "Preview alias; answered here by the served DiffusionGemma"),
)
RELEASE_DATE = "2026-11-29"


async def systemone(request: Request) -> Response:
    svc = services(request)
    raw = await read_raw(request, svc.settings.limits.max_body_bytes)
    prepared = await svc.prepare(prepare, raw.inline_size, svc, raw)
    outcome = await decide(svc, prepared, "systemone", request.receive)
    return await json_reply(svc, jev_body(svc.reader.info.model, outcome), options_in(prepared.decision))


async def models(request: Request) -> Response:
    svc = services(request)
    served = svc.reader.info
    entries = [{"name": name, "description": text, "release_date": RELEASE_DATE} for name, text in JEV_ALIASES]
    note = " (tiny random-weight model: answers are random)" if served.tiny else ""
    entries.append({
        "name": served.model,
        "description": f"DiffusionGemma canvas reads on the {served.engine} engine, {served.device}{note}",
        "release_date": RELEASE_DATE,
    })
    return json_response({"models": entries})


routes = [
    Route("/v1/systemone", systemone, methods=["POST"]),
    Route("/v1/decisions", systemone, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
]
