"""The OpenAI-compatible HTTP server: `build_app(EngineArgs(...))` returns a Starlette app."""

from __future__ import annotations

__all__ = ["ServerConfig", "aserve_lifespan", "build_app"]


def __getattr__(name: str):
    # The app pulls in the engine (and torch); `python -m aserve --help` should not wait for it.
    if name in __all__:
        from aserve.server import app

        return getattr(app, name)
    raise AttributeError(name)
