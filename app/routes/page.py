"""``GET /``: the web page, one static HTML file with its script and stylesheet.

The files ship as package data under ``app/static/``; there is no build step. The page
talks to the API like any other client (section 9 of the spec).
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

from lib.errors import NotFound

router = APIRouter(include_in_schema=False)

_JS = "text/javascript; charset=utf-8"
_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "graph.css": "text/css; charset=utf-8",
    "page.js": _JS,
    "list.js": _JS,
    "api.js": _JS,
    "dom.js": _JS,
    "events.js": _JS,
    "format.js": _JS,
    "forms.js": _JS,
    "keys.js": _JS,
    "launch.js": _JS,
    "panel.js": _JS,
    "pause.js": _JS,
    "routing.js": _JS,
    "timeline.js": _JS,
    "values.js": _JS,
    "watch.js": _JS,
    "graph.js": _JS,
    "graph-layout.js": _JS,
}
# Everything the page loads comes from this server; values are shown as text, never markup.
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
}


@functools.cache
def _asset(name: str) -> bytes:
    return resources.files("app").joinpath("static", name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_asset(name), media_type=_ASSETS[name], headers=_HEADERS)


@router.get("/")
async def index() -> Response:
    """The page."""
    return _serve("index.html")


@router.get("/static/{name}")
async def asset(name: str) -> Response:
    """The page's scripts and stylesheets."""
    if name not in _ASSETS or name == "index.html":
        raise NotFound("asset", name)
    return _serve(name)
