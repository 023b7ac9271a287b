"""The built-in web pages: a chat playground at `/` and the engine's dashboard at `/dashboard`.

They are plain HTML, CSS and ES modules in `static/` (package data), served as they are by
Starlette's `StaticFiles`: no build step, no CDN. Every URL in them is relative, so they work
where the app is mounted (`/llm/`). The pages and their files carry nothing secret and need no
API key; the page asks for the key and sends it with its API calls, the dashboard's figures
(`dashboard.py`) included. `--disable-frontend` leaves these routes out: all of them are a 404.

This module knows nothing of the engine; `dashboard.py` serves the figures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from aserve.server.dashboard import dashboard_stats

STATIC_DIR = Path(__file__).resolve().parent / "static"
PLAYGROUND_PATH = "/"
DASHBOARD_PATH = "/dashboard"
STATS_PATH = "/dashboard/stats"  # JSON, behind the API key like /v1
STATIC_PATH = "/static"

HEADERS = {
    # Kept, but revalidated on each use: the ETag / Last-Modified StaticFiles sends turn that
    # into a 304, and a new aserve's files are picked up at once without fingerprinted names
    # (which would take a build step).
    "Cache-Control": "no-cache",
    # Scripts and styles come from these files only: no inline script, no eval, no other
    # origin. A model's reply that slipped past the renderer still could not run.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class StaticAssets(StaticFiles):
    """`StaticFiles`, with `HEADERS` on every answer (304s included)."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


def frontend_routes() -> list[BaseRoute]:
    assets = StaticAssets(directory=STATIC_DIR)

    def page(name: str) -> Callable[[Request], Awaitable[Response]]:
        """One of the files as a page of its own (conditional requests answered too)."""
        async def endpoint(request: Request) -> Response:
            return await assets.get_response(name, request.scope)
        return endpoint

    return [
        Route(PLAYGROUND_PATH, page("index.html"), methods=["GET"]),
        Route(DASHBOARD_PATH, page("dashboard.html"), methods=["GET"]),
        Route(STATS_PATH, dashboard_stats, methods=["GET"]),
        Mount(STATIC_PATH, assets),
    ]
