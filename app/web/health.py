"""`GET /health`: always open, no token; says which model answers and how loaded the server is."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.web.errors import json_response
from app.web.services import services


async def health(request: Request) -> Response:
    svc = services(request)
    info = svc.reader.info
    ready = svc.reader.ready
    body = {
        "status": "ok" if ready else "unavailable",
        "ready": ready,
        "model": info.model,
        "engine": info.engine,
        "device": info.device,
        "tiny": info.tiny,
        "canvas": info.canvas_length,
        "in_flight": svc.admission.in_flight,
        "in_flight_cost": svc.admission.cost,
        "sessions": len(svc.sessions),
        "uptime_s": round(time.time() - svc.started, 1),
    }
    if info.tiny:
        body["warning"] = "tiny random-weight model: every answer is random"
    return json_response(body, status=200 if ready else 503)


routes = [Route("/health", health, methods=["GET"])]
