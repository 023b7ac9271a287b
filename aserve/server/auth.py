"""The API key: which paths need it (`needs_api_key`) and the middleware that checks it.

`/v1/*`, `/tokenize`, `/detokenize`, the pooling routes outside `/v1` (`/score`, `/rerank`,
`/v2/rerank`) and the dashboard's figures need `Authorization: Bearer <key>` (tokenizing runs
the chat template, a request's own included, so it is guarded like generation); the web pages
and their static files do not (they hold no data: the page sends the key with its own calls),
nor do the operational routes SECURITY.md lists. Paths are read under the mount's root path.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from aserve.server.errors import error_response
from aserve.server.frontend import STATS_PATH

GUARDED_PREFIX = "/v1"
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank",
                           STATS_PATH})


def needs_api_key(path: str) -> bool:
    """`path` is relative to the app's root (`/v1/models`, not `/llm/v1/models`)."""
    return path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS


class ApiKeyMiddleware:
    """Guarded paths need `Authorization: Bearer <key>`; compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response("Invalid or missing API key.", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _guarded(scope: Scope) -> bool:
        root, path = scope.get("root_path", ""), scope["path"]
        return path.startswith(root) and needs_api_key(path[len(root):])
