"""`POST /v1/systemone` (and its alias `/v1/decisions`) and `GET /v1/models`, in Jev's shapes.

Parse, decide, serialize: no model logic lives here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.decisions.errors import RequestError
from app.decisions.request import Decision, parse_decision
from app.decisions.run import Outcome
from app.web.body import read_payload
from app.web.errors import HTTPError, json_response

if TYPE_CHECKING:
    from app.server import Services

log = logging.getLogger("djev.decisions")

# Jev's model aliases (spec/jev-contract.md §1.9). Any model id is accepted on a decision; the
# served model's name is what answers.
JEV_ALIASES = (
    ("jev-latest", "Latest stable decision model; answered here by the served DiffusionGemma"),
    ("jev-preview", "Preview alias; answered here by the served DiffusionGemma"),
)
RELEASE_DATE = "2026-11-29"


def services(request: Request) -> "Services":
    return request.app.state.services


async def decide(svc: "Services", decision: Decision, route: str) -> Outcome:
    """Run one decision under admission control and log it in one line."""
    with svc.admission.slot():
        outcome = await svc.decider.decide(decision)
    log.info("%s: %s", route, outcome.summary)
    return outcome


def jev_response(svc: "Services", outcome: Outcome) -> dict:
    return {
        "model": svc.reader.info.model,
        "answers": outcome.answers,
        "usage": {"input_tokens": int(outcome.input_tokens), "output_tokens": int(outcome.output_tokens)},
        "diagnostics": outcome.diagnostics,
    }


async def systemone(request: Request) -> Response:
    svc = services(request)
    payload = await read_payload(request, svc.settings.max_body_bytes)
    try:
        decision = parse_decision(payload.body, svc.settings.limits, images=payload.images, assets=payload.assets)
    except RequestError as exc:
        raise HTTPError.from_request_error(exc) from None
    svc.check_images(decision)
    outcome = await decide(svc, decision, "systemone")
    return json_response(jev_response(svc, outcome))


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
