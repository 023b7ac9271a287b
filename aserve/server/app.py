"""`build_app`: the OpenAI-compatible Starlette app, mountable inside another service.

    app = build_app(EngineArgs(model="..."))            # serve it with uvicorn, or
    parent.mount("/llm", app)                           # mount it; see examples/

The app's lifespan starts the engine thread and stops it. Starlette does not run the lifespan of
a mounted sub-app, so a parent app enters `aserve_lifespan(app)` from its own lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aserve
from aserve.engine.arg_utils import EngineArgs
from aserve.engine.async_engine import AsyncEngine
from aserve.server import routes
from aserve.server.auth import ApiKeyMiddleware
from aserve.server.chat import create_chat_completion
from aserve.server.completions import create_completion
from aserve.server.errors import EXCEPTION_HANDLERS, error_response
from aserve.server.frontend import frontend_routes
from aserve.server.metrics import ServerMetrics
from aserve.server.openapi import openapi_json
from aserve.server.pooling import create_embedding, create_rerank, create_score
from aserve.server.reasoning_parsers import get_reasoning_parser
from aserve.server.responses_api import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from aserve.server.responses_store import ResponseStore
from aserve.server.tool_parsers import get_tool_parser


@dataclass
class ServerConfig:
    """Frontend settings that are not the engine's."""

    served_model_name: str | None = None  # default: the model path
    api_key: str | None = None
    chat_template: str | None = None  # a template string, or a path to a file holding one
    # Accept a request's own `chat_template` (bounded: `aserve/engine/chat_template.py`);
    # off, such a request is a 400 (vLLM's --trust-request-chat-template)
    trust_request_chat_template: bool = False
    allowed_origins: list[str] = field(default_factory=list)  # CORS off unless given
    max_request_body_bytes: int = 16 << 20
    # Backpressure: engine requests (completions) allowed to wait beyond the `max_num_seqs`
    # that can run; past it a request is refused at once with 503 + Retry-After.
    max_waiting_requests: int = 512
    request_timeout: float | None = None  # seconds a request may take; then it is aborted
    # A stream whose client reads nothing for this long is aborted (its slots and KV blocks
    # come back) and its connection closed; None or 0: never (`serving.EventStream`)
    stream_stall_timeout: float | None = 30.0
    liveness_timeout: float = 30.0  # `/health?generate=1`: seconds to produce one token
    enable_auto_tool_choice: bool = False  # vLLM's flag, accepted: auto tool choice is always on
    # the model's tool-call format (`tool_parsers/`); None: the one its chat template renders
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # <think> -> reasoning_content (`reasoning_parsers.py`)
    disable_frontend: bool = False  # no playground, dashboard or their files (`frontend.py`)
    # The Responses API's stored responses (`responses_store.py`): at most this many, and
    # this many bytes of them; 0 responses: none is stored
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 256 << 20


class ServerState:
    """What the routes share: the engine, the config, the metrics. Lives in `app.state.aserve`."""

    def __init__(self, engine_args: EngineArgs, config: ServerConfig) -> None:
        self.engine_args = engine_args
        self.config = config
        self.model_name = (config.served_model_name or engine_args.served_model_name
                           or engine_args.model)
        self.engine: AsyncEngine | None = None
        self.metrics = ServerMetrics(self.model_name)
        self.responses = ResponseStore(config.max_stored_responses,
                                       config.max_stored_response_bytes)
        self.background: dict[str, asyncio.Task] = {}  # background responses running
        self.chat_template = _read_template(config.chat_template)
        if config.tool_call_parser is not None:
            get_tool_parser(config.tool_call_parser)  # ValueError now, not at each request
        if config.reasoning_parser is not None:
            get_reasoning_parser(config.reasoning_parser)


def _read_template(value: str | None) -> str | None:
    if value is None or "{" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


@contextlib.asynccontextmanager
async def aserve_lifespan(app: Starlette) -> AsyncIterator[None]:
    """Start the engine for the app's lifetime (use it from a parent app's lifespan too)."""
    state: ServerState = app.state.aserve
    engine = AsyncEngine(state.engine_args)
    try:
        await engine.start()
    except BaseException:
        # the engine thread ends on its own after a failed start; wait for it (and its
        # worker's torch calls), or the interpreter may exit under it (a C++ abort at exit)
        await engine.shutdown()
        raise
    state.engine = engine
    state.metrics.bind_engine(engine)
    try:
        yield
    finally:
        await engine.shutdown()


async def health(request: Request) -> Response:
    """200 while the engine runs; 503 with the reason once it has died. With `?generate=1` it
    also generates one token through the engine (a liveness probe that tells a stuck engine
    from a busy one), within `ServerConfig.liveness_timeout`."""
    state: ServerState = request.app.state.aserve
    engine = state.engine
    if engine is None or not engine.is_running:
        reason = engine.dead_error if engine is not None else "The engine is not running."
        return error_response(reason or "The engine is not running.", 503)
    if request.query_params.get("generate") not in (None, "", "0", "false"):
        reason = await engine.probe(state.config.liveness_timeout)
        if reason is not None:
            return error_response(reason, 503)
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": aserve.__version__})


def build_app(engine_args: EngineArgs, config: ServerConfig | None = None) -> Starlette:
    config = config or ServerConfig()
    middleware = []
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"]))
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    pages = [] if config.disable_frontend else frontend_routes()
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", routes.retrieve_model, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/embeddings", create_embedding, methods=["POST"]),
            *(Route(path, create_score, methods=["POST"]) for path in ("/v1/score", "/score")),
            *(Route(path, create_rerank, methods=["POST"])
              for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", list_input_items,
                  methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
            *pages,
        ],
        middleware=middleware,
        lifespan=aserve_lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.aserve = ServerState(engine_args, config)
    return app
