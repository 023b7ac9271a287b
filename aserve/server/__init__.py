"""The OpenAI-compatible HTTP server: `build_app(EngineArgs(...))` returns a Starlette app."""

from __future__ import annotations

from aserve.server.app import ServerConfig, aserve_lifespan, build_app

__all__ = ["ServerConfig", "aserve_lifespan", "build_app"]
