"""The browser pages: / (playground), /walk (phone hazard demo), /cube (Cube Rule classifier).

The walk page installs to a phone's home screen: /walk.webmanifest is its web app manifest and
/sw.js its service worker (page shell only), served from the root so that it may control /walk;
/djev-ca.crt is the local certificate authority a phone installs once to trust the HTTPS port.

Jinja2 templates in app/templates, vanilla ES modules and CSS in app/static; no build step and no
external network (fonts and images are served by the app). Every page shares a header that says
which model and engine answer, with a banner when it is the tiny random-weight model, and one while
the model is starting (its phase, kept current from /health until the model is ready).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from app.engine.starting import StartingReader

if TYPE_CHECKING:
    from app.web.services import Services

APP_DIR = Path(__file__).resolve().parent.parent
TEMPLATES = Environment(
    loader=FileSystemLoader(str(APP_DIR / "templates")),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
PAGES = {"/": "playground.html", "/playground": "playground.html", "/walk": "walk.html", "/cube": "cube.html"}


def page_context(services: "Services", path: str) -> dict:
    reader = services.reader
    info = reader.info
    starting = reader.status if isinstance(reader, StartingReader) and not reader.ready else None
    return {
        "model": info.model,
        "engine": info.engine,
        "device": info.device,
        "tiny": info.tiny,
        "key_required": bool(services.settings.server.api_key),
        "path": path,
        # While the model loads: the banner, which app/static/js/startup.js keeps current from /health.
        "starting": starting if starting is not None and starting.state == "starting" else None,
    }


def render(request: Request) -> Response:
    path = request.url.path.rstrip("/") or "/"
    template = TEMPLATES.get_template(PAGES[path])
    html = template.render(**page_context(request.app.state.services, path))
    return HTMLResponse(html, headers={"cache-control": "no-store"})


async def page(request: Request) -> Response:
    return render(request)


WALK_ASSETS = APP_DIR / "static" / "walk"


async def walk_manifest(request: Request) -> Response:
    return FileResponse(WALK_ASSETS / "manifest.webmanifest", media_type="application/manifest+json",
                        headers={"cache-control": "no-cache"})


async def walk_service_worker(request: Request) -> Response:
    # A worker's scope can reach no higher than the folder its script is served from; served at the
    # root, it may control /walk. no-cache: the browser's update check always sees the current file.
    return FileResponse(WALK_ASSETS / "sw.js", media_type="text/javascript",
                        headers={"cache-control": "no-cache"})


async def ca_certificate(request: Request) -> Response:
    # The local certificate authority's certificate (public; its key never leaves certs/), for a
    # phone to install once so that the HTTPS port is trusted. Absent until TLS was first enabled.
    from app.tls import CA_CERT_NAME

    path = Path(request.app.state.services.settings.server.cert_dir) / CA_CERT_NAME
    if not path.is_file():
        return Response("no local certificate authority yet: start djev with --tls-port\n", status_code=404,
                        media_type="text/plain")
    headers = {"cache-control": "no-cache", "content-disposition": 'attachment; filename="djev-ca.crt"'}
    return FileResponse(path, media_type="application/x-x509-ca-cert", headers=headers)


routes = [Route(path, page, methods=["GET"]) for path in PAGES] + [
    Route("/walk.webmanifest", walk_manifest, methods=["GET"]),
    Route("/sw.js", walk_service_worker, methods=["GET"]),
    Route("/djev-ca.crt", ca_certificate, methods=["GET"]),
    Mount("/static", app=StaticFiles(directory=str(APP_DIR / "static")), name="static"),
]
