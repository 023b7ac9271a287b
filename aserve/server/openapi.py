"""The app's OpenAPI 3.1 document, served at `/openapi.json`.

Built from the app's own routes and the pydantic models the routes parse and answer with
(`protocol.py`, `responses.py`, `errors.py`), so it lists exactly what the app serves: request
bodies with their limits, each route's JSON or `text/event-stream` answer, and the error statuses
the code really sends, all in one error shape (`errors.py`). Accurate enough to drive a
schema-based fuzzer. Built once per app, on the first request. Not a validator: requests are
checked by the models themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

import aserve
from aserve.server import pooling_protocol, protocol, responses, responses_items
from aserve.server.auth import needs_api_key
from aserve.server.dashboard import DashboardStats
from aserve.server.errors import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
SSE = "text/event-stream"
# Error statuses, as `components/responses` names them; every body is an `ErrorResponse`.
ERRORS = {
    400: ("BadRequest", "The request is invalid: malformed JSON, a field of the wrong type or "
          "out of range, a request over a size limit, or a prompt too long for the context. "
          "`error.param` names the field where known."),
    401: ("Unauthorized", "Missing or wrong `Authorization: Bearer` API key."),
    404: ("NotFound", "The request names a `model` this server does not serve."),
    413: ("PayloadTooLarge", "The request body is larger than the server's limit."),
    503: ("ServiceUnavailable", "The engine is not running, or the server is overloaded (then "
          "with `Retry-After`, in seconds)."),
    504: ("GatewayTimeout", "The request did not finish within the server's request timeout."),
}
STREAM_DESCRIPTION = (
    "OK: the JSON object; with `\"stream\": true`, server-sent events `data: <chunk JSON>` "
    "(`x-event-data-schema`) ending with `data: [DONE]`. A failure after the first event "
    "arrives in-band as `data: <ErrorResponse JSON>`.")
BODY_ERRORS = (400, 404, 413, 503)  # what a route that parses a body can answer
GENERATION_ERRORS = (*BODY_ERRORS, 504)


@dataclass(frozen=True)
class Operation:
    """One route's documentation: its request body, 200 answer(s) and error statuses."""

    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | dict | None = None  # the 200 JSON body; None: no body
    stream: type[BaseModel] | None = None  # each event's data with `"stream": true`
    media_type: str = "application/json"
    errors: tuple[int, ...] = ()
    parameters: list[dict] = field(default_factory=list)


RESPONSE_SCHEMA = {"type": "object", "description": "OpenAI's Response object.",
                   "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                  "status": {"type": "string"}, "output": {"type": "array"}},
                   "required": ["id", "object", "status", "output"]}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
               "schema": {"type": "string"}}
VERSION_SCHEMA = {"type": "object", "properties": {"version": {"type": "string"}},
                  "required": ["version"]}
OPERATIONS = {
    "/health": Operation(
        "200 (no body) while the engine runs; 503 with the reason once it has died.",
        errors=(503,), parameters=[{
            "name": "generate", "in": "query", "required": False, "schema": {"type": "string"},
            "description": "Any value but `0`/`false`: also generate one token (a liveness "
                           "probe)."}]),
    "/version": Operation("The aserve version.", response=VERSION_SCHEMA),
    "/metrics": Operation("Prometheus metrics.", response={"type": "string"},
                          media_type="text/plain"),
    "/openapi.json": Operation("This document.", response={"type": "object"}),
    "/": Operation("The chat playground: a web page.", response={"type": "string"},
                   media_type="text/html"),
    "/dashboard": Operation("The engine's live dashboard: a web page.",
                            response={"type": "string"}, media_type="text/html"),
    "/dashboard/stats": Operation("The engine's live figures, as the dashboard polls them.",
                                  response=DashboardStats, errors=(503,)),
    "/static/{path}": Operation(
        "The web pages' files (HTML, CSS, JavaScript modules).", response={"type": "string"},
        media_type="application/octet-stream", parameters=[{
            "name": "path", "in": "path", "required": True, "schema": {"type": "string"}}]),
    "/v1/models": Operation("The served model.", response=responses.ModelList, errors=(503,)),
    "/v1/models/{model_id}": Operation(
        "The served model's card, by its id (404: not served here).",
        response=responses.ModelCard, errors=(404, 503), parameters=[{
            "name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]),
    "/tokenize": Operation("Tokenize a prompt, or chat messages rendered by the chat template.",
                           protocol.TokenizeRequest, responses.TokenizeResponse,
                           errors=BODY_ERRORS),
    "/detokenize": Operation("Turn token ids back into text.", protocol.DetokenizeRequest,
                             responses.DetokenizeResponse, errors=BODY_ERRORS),
    "/v1/completions": Operation(
        "Complete one or more prompts.", protocol.CompletionRequest,
        responses.CompletionResponse, responses.CompletionStreamResponse,
        errors=GENERATION_ERRORS),
    "/v1/chat/completions": Operation(
        "Answer a conversation.", protocol.ChatCompletionRequest,
        responses.ChatCompletionResponse, responses.ChatCompletionStreamResponse,
        errors=GENERATION_ERRORS),
    "/v1/embeddings": Operation(
        "Embed texts or token ids (the pooling runner; 400 on a generating model).",
        pooling_protocol.EmbeddingRequest, pooling_protocol.EmbeddingResponse,
        errors=GENERATION_ERRORS),
    **{path: Operation(
        "Score text pairs: the cosine of their embeddings (the pooling runner).",
        pooling_protocol.ScoreRequest, pooling_protocol.ScoreResponse,
        errors=GENERATION_ERRORS) for path in ("/v1/score", "/score")},
    **{path: Operation(
        "Rerank documents by the cosine of their embedding with the query's (the pooling "
        "runner).", pooling_protocol.RerankRequest, pooling_protocol.RerankResponse,
        errors=GENERATION_ERRORS) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    "/v1/responses": Operation(
        "Create a response (OpenAI's Responses API): the Response object; with "
        "`\"stream\": true`, its typed events (`event: <type>`, `data: <event JSON>`).",
        responses_items.ResponsesRequest, RESPONSE_SCHEMA, errors=GENERATION_ERRORS),
    "/v1/responses/{response_id}": Operation(
        "GET: a stored response; DELETE: forget it (404: never stored, deleted or evicted).",
        response=RESPONSE_SCHEMA, errors=(404,), parameters=[RESPONSE_ID]),
    "/v1/responses/{response_id}/cancel": Operation(
        "Cancel a background response: stored as cancelled (a finished one is returned as "
        "it is; 400: not a background response).", response=RESPONSE_SCHEMA,
        errors=(400, 404), parameters=[RESPONSE_ID]),
    "/v1/responses/{response_id}/input_items": Operation(
        "A stored response's input items, a list page (`order`, `limit`, `after`).",
        response={"type": "object"}, errors=(400, 404), parameters=[RESPONSE_ID]),
}


def _models() -> list[type[BaseModel]]:
    models = [ErrorResponse]
    for op in OPERATIONS.values():
        models += [m for m in (op.request, op.response, op.stream)
                   if isinstance(m, type) and issubclass(m, BaseModel)]
    return list(dict.fromkeys(models))


def component_schemas() -> tuple[dict[type[BaseModel], dict], dict[str, dict]]:
    """Each model's `$ref`, and every schema under its name. Responses use the validation
    mode too: the serialization schema of `DeltaMessage` (a wrap serializer) says nothing."""
    refs, defs = models_json_schema([(m, "validation") for m in _models()],
                                    ref_template=REF_TEMPLATE)
    return {model: ref for (model, _), ref in refs.items()}, defs.get("$defs", {})


def _json_content(schema: dict, media_type: str = "application/json") -> dict:
    return {media_type: {"schema": schema}}


def _schema(value: type[BaseModel] | dict, refs: dict) -> dict:
    return value if isinstance(value, dict) else refs[value]


def _ok_response(op: Operation, refs: dict) -> dict:
    if op.response is None:
        return {"description": "OK (no body)."}
    content = _json_content(_schema(op.response, refs), op.media_type)
    if op.stream is not None:
        content[SSE] = {"schema": {"type": "string"}, "x-event-data-schema": refs[op.stream]}
        return {"description": STREAM_DESCRIPTION, "content": content}
    return {"description": "OK.", "content": content}


def _operation(path: str, method: str, op: Operation, refs: dict, statuses: list[int],
               secured: bool) -> dict:
    responses_ = {"200": _ok_response(op, refs)}
    responses_ |= {str(s): {"$ref": f"#/components/responses/{ERRORS[s][0]}"} for s in statuses}
    doc: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(method, path),
                           "responses": responses_}
    if op.parameters:
        doc["parameters"] = op.parameters
    if op.request is not None:
        doc["requestBody"] = {"required": True, "content": _json_content(refs[op.request])}
    if secured:
        doc["security"] = [{"bearerAuth": []}]
    return doc


def _operation_id(method: str, path: str) -> str:
    words = path.strip("/").replace(".", "_").replace("/", "_") or "root"
    return f"{method.lower()}_{words}"


def _routes(routes: list[BaseRoute], prefix: str = "") -> list[tuple[str, list[str]]]:
    """(path, methods) of every HTTP route, mounted sub-apps' routes included."""
    found = []
    for route in routes:
        path = prefix + getattr(route, "path", "")
        if isinstance(route, Mount) and isinstance(route.app, StaticFiles):
            found.append((path + "/{path}", ["GET"]))
        elif isinstance(route, Mount):
            found += _routes(route.routes, path)
        elif getattr(route, "methods", None):  # ({id:path} is OpenAPI's {id})
            found.append((re.sub(r"\{(\w+):\w+\}", r"{\1}", path),
                          sorted(m for m in route.methods if m != "HEAD")))
    return found


def _error_components(refs: dict) -> dict[str, dict]:
    out = {}
    for name, description in ERRORS.values():
        out[name] = {"description": description,
                     "content": _json_content(refs[ErrorResponse])}
    out["ServiceUnavailable"]["headers"] = {"Retry-After": {
        "description": "Seconds to wait before retrying (sent when overloaded).",
        "schema": {"type": "integer"}}}
    return out


def _settings(app: Any) -> tuple[bool, bool]:
    """(an API key guards the routes `needs_api_key` names, a request timeout is set) for the
    app, if it is aserve's."""
    state = getattr(app.state, "aserve", None)
    config = getattr(state, "config", None)
    return (bool(getattr(config, "api_key", None)),
            getattr(config, "request_timeout", None) is not None)


def build_openapi(app: Any, root_path: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app` (a Starlette app, usually `build_app`'s): every route
    it serves; routes aserve does not know are listed with a bare 200."""
    refs, schemas = component_schemas()
    keyed, timeout = _settings(app)
    paths: dict[str, dict] = {}
    for path, methods in _routes(app.routes):
        op = OPERATIONS.get(path, Operation(f"{path} (undocumented)."))
        secured = keyed and needs_api_key(path)
        statuses = sorted({*(s for s in op.errors if s != 504 or timeout),
                           *((401,) if secured else ())})
        paths[path] = {m.lower(): _operation(path, m, op, refs, statuses, secured)
                       for m in methods}
    components: dict[str, Any] = {"schemas": schemas, "responses": _error_components(refs)}
    if keyed:
        components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    doc = {"openapi": "3.1.0",
           "info": {"title": "aserve", "version": aserve.__version__,
                    "description": "An OpenAI-compatible LLM inference server."},
           "paths": paths, "components": components}
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc


async def openapi_json(request: Request) -> JSONResponse:
    """`GET /openapi.json`: the document, built on the first request and kept on the app."""
    state = request.app.state
    doc = getattr(state, "openapi_document", None)
    if doc is None:
        doc = build_openapi(request.app, request.scope.get("root_path", ""))
        state.openapi_document = doc
    return JSONResponse(doc)
