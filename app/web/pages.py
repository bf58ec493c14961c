"""The browser pages: / (playground), /walk (phone hazard demo), /cube (Cube Rule classifier).

Jinja2 templates in app/templates, vanilla ES modules and CSS in app/static; no build step and no
external network (fonts and images are served by the app). Every page shares a header that says
which model and engine answer, with a banner when it is the tiny random-weight model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

if TYPE_CHECKING:
    from app.server import Services

APP_DIR = Path(__file__).resolve().parent.parent
TEMPLATES = Environment(
    loader=FileSystemLoader(str(APP_DIR / "templates")),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
PAGES = {"/": "playground.html", "/playground": "playground.html", "/walk": "walk.html", "/cube": "cube.html"}


def page_context(services: "Services", path: str) -> dict:
    info = services.reader.info
    return {
        "model": info.model,
        "engine": info.engine,
        "device": info.device,
        "tiny": info.tiny,
        "key_required": bool(services.settings.api_key),
        "path": path,
    }


def render(request: Request) -> Response:
    path = request.url.path.rstrip("/") or "/"
    template = TEMPLATES.get_template(PAGES[path])
    html = template.render(**page_context(request.app.state.services, path))
    return HTMLResponse(html, headers={"cache-control": "no-store"})


async def page(request: Request) -> Response:
    return render(request)


routes = [Route(path, page, methods=["GET"]) for path in PAGES] + [
    Mount("/static", app=StaticFiles(directory=str(APP_DIR / "static")), name="static"),
]
