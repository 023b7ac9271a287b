"""Fuzzing the HTTP API with hypothesis: whatever the body of a POST to /v1/completions,
/v1/chat/completions, /v1/responses, /tokenize or /detokenize — any JSON, a valid body with one
field replaced by any JSON, raw or truncated bytes, or a body generated from the app's own
`/openapi.json` — the
server answers 2xx with a well-formed body or 4xx in OpenAI's error shape, never 5xx, and keeps
serving. Cost stays small: `max_model_len` is 32 (whatever `max_tokens` the fuzzer picks), and
generated `n`, arrays and objects are capped.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from helpers.server import serving, tiny_app
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.routing import Mount

from aserve.server import ServerConfig, responses
from aserve.server.openapi import build_openapi

pytestmark = pytest.mark.spawns  # a uvicorn server on a port

MODEL = "tiny"
MAX_MODEL_LEN = 32  # bounds the cost of any max_tokens, or of its default
MAX_N = 3  # the fuzzer's own caps (the server's limits are tested in test_limits.py)
MAX_SIZE = 3  # items of a generated array or object
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

USER = [{"role": "user", "content": "Hi"}]
VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "Hello"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6]},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
}
ROUTES = sorted(VALID)


def _sdk_type(type_: Any) -> Callable[[Any], Any]:
    """A validator of the openai SDK's own type (the Responses API's have no pydantic model
    here: they are built as dicts)."""
    from openai._models import validate_type

    return lambda value: validate_type(type_=type_, value=value)


def _responses_validators() -> tuple[Callable, Callable]:
    from openai.types.responses import Response, ResponseStreamEvent

    return _sdk_type(Response), _sdk_type(ResponseStreamEvent)


# route: (validator of a 200 JSON body, validator of each server-sent event's data)
OK_MODELS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any] | None]] = {
    "/v1/completions": (responses.CompletionResponse.model_validate,
                        responses.CompletionStreamResponse.model_validate),
    "/v1/chat/completions": (responses.ChatCompletionResponse.model_validate,
                             responses.ChatCompletionStreamResponse.model_validate),
    "/tokenize": (responses.TokenizeResponse.model_validate, None),
    "/detokenize": (responses.DetokenizeResponse.model_validate, None),
    "/v1/responses": _responses_validators(),
}

SCALARS = (st.none() | st.booleans() | st.integers()
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=MAX_SIZE)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=MAX_SIZE),
                    max_leaves=8)
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "", "application/x-www-form"
                                 "-urlencoded", "application/json; charset=latin-1"])


@pytest.fixture(scope="module")
def app(model_dir_factory):
    return tiny_app(model_dir_factory("llama"), ServerConfig(served_model_name=MODEL),
                    max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(app):
    with serving(app) as url, httpx.Client(base_url=url, timeout=60.0) as client:
        yield client


class OpenApi(dict):
    """The served document, with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return "<GET /openapi.json>"


@pytest.fixture(scope="module")
def openapi(client) -> OpenApi:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return OpenApi(response.json())


# --- checks ------------------------------------------------------------------------------------


def post(client: httpx.Client, route: str, content: bytes,
         content_type: str = "application/json") -> httpx.Response:
    # A fresh connection each time: a failed example must not break the next one's.
    return client.post(route, content=content,
                       headers={"content-type": content_type, "connection": "close"})


def check_answer(client: httpx.Client, route: str, response: httpx.Response, sent: Any) -> None:
    """No 5xx; errors in OpenAI's shape; 200 bodies parse as the route's response model; the
    server still healthy."""
    where = f"POST {route} {sent!r:.400} -> {response.status_code} {response.text[:400]}"
    event(f"{route} {response.status_code}")
    health = settled(client)
    assert response.status_code < 500, where
    if response.status_code >= 400:
        check_error_body(response.json(), response.status_code, where)
    elif response.headers["content-type"].startswith("text/event-stream"):
        check_events(route, response.text, where)
    else:
        OK_MODELS[route][0](response.json())
    assert health == 200, where


def settled(client: httpx.Client) -> int:
    """`/health`'s status; once it answers, the server is done logging the previous request
    (uvicorn logs a 500's traceback after sending it). Python 3.11 before 3.11.8 formats
    tracebacks with `ast.parse`, whose state is process-wide: pytest building a failure report at
    the same time would die with "AST constructor recursion depth mismatch"."""
    return client.get("/health").status_code


def check_error_body(body: dict, status: int, where: str) -> None:
    assert set(body) == {"error"}, where
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert isinstance(error["message"], str) and error["message"], where
    assert isinstance(error["type"], str) and error["type"].endswith("Error"), where
    assert error["code"] == status, where
    assert error["param"] is None or isinstance(error["param"], str), where


def check_events(route: str, text: str, where: str) -> None:
    """Chunks end with `data: [DONE]`; the Responses API's typed events (`event: <type>`
    lines) end with the response's last state instead. No failure after the start."""
    events = [line.split("data: ", 1)[1] for line in text.split("\n\n") if line]
    if route == "/v1/responses":
        assert events and json.loads(events[-1])["type"] in (
            "response.completed", "response.incomplete"), where
    else:
        assert events and events.pop() == "[DONE]", where
    for data in events:
        chunk = json.loads(data)
        assert "error" not in chunk and chunk.get("type") != "error", where
        OK_MODELS[route][1](chunk)


# --- strategies ----------------------------------------------------------------------------------


def request_schema(openapi: dict, route: str) -> dict:
    body = openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]
    return resolve(openapi, body["schema"])


def resolve(openapi: dict, schema: dict) -> dict:
    if "$ref" not in schema:
        return schema
    return openapi["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]


def one_field_replaced(openapi: dict, route: str) -> st.SearchStrategy[dict]:
    """A valid body with one of the request's fields (or an unknown one) set to any JSON."""
    fields = sorted(request_schema(openapi, route)["properties"]) + ["unknown_field"]
    return st.tuples(st.sampled_from(fields), JSON).map(lambda kv: VALID[route] | dict([kv]))


HOSTILE_BYTES = [
    b"[" * 100_000,  # nesting past any recursion limit
    b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}',  # surrogates
    b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",  # a 5001-digit number
    b'{"prompt": "a", "temperature": NaN, "top_p": Infinity}',
    b'{"prompt": "a", "prompt": ["b"], "max_tokens": 1, "max_tokens": 2}',  # duplicate keys
    b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 1}',  # a UTF-8 byte order mark
    b'{"prompt": "a\x00b", "tokens": [0], "messages": [{"role": "\x00"}]}',  # raw NULs
    b'{"prompt": "a\\u0000b", "messages": [{"role": "\\u0000", "content": "\\u0000"}]}',
]


def raw_bodies(route: str) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, a valid body cut short, or one with bytes spliced in (mostly invalid
    UTF-8), or re-encoded as UTF-16."""
    valid = json.dumps(VALID[route]).encode()
    cut = st.integers(0, len(valid))
    return st.one_of(
        st.binary(max_size=64),
        cut.map(lambda k: valid[:k]),
        st.tuples(cut, st.binary(min_size=1, max_size=4)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
        st.sampled_from(HOSTILE_BYTES),
        st.just(json.dumps(VALID[route]).encode("utf-16")),
    )


# Fields the schema walk draws from narrower strategies: realism (the served model, mostly) and
# cost (n).
OVERRIDES = {
    "model": st.sampled_from([MODEL, MODEL, None, "other-model"]),
    "n": st.none() | st.integers(1, MAX_N),
}


def from_schema(openapi: dict, schema: dict) -> st.SearchStrategy:
    """Bodies that follow a JSON schema (the subset pydantic writes), arrays and objects capped
    at MAX_SIZE items."""
    schema = resolve(openapi, schema)
    if "anyOf" in schema:
        return st.one_of([from_schema(openapi, s) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([objects(openapi, one_branch(schema, i))
                          for i in range(len(schema["oneOf"]))])
    if "properties" in schema:
        return objects(openapi, schema)
    kind = schema.get("type")
    return JSON if kind is None else SCHEMA_KINDS[kind](openapi, schema)


def one_branch(schema: dict, index: int) -> dict:
    """`schema` narrowed to its oneOf's branch `index` (each branch requires some fields): those
    fields required and not null, the other branches' fields left out."""
    required = schema["oneOf"][index]["required"]
    others = {name for branch in schema["oneOf"] for name in branch["required"]} - set(required)
    properties = {name: s for name, s in schema["properties"].items() if name not in others}
    for name in required:
        properties[name] = {"anyOf": [s for s in properties[name]["anyOf"]
                                      if s != {"type": "null"}]}
    narrowed = {k: v for k, v in schema.items() if k != "oneOf"}
    return narrowed | {"required": schema.get("required", []) + required,
                       "properties": properties}


def objects(openapi: dict, schema: dict) -> st.SearchStrategy[dict]:
    """The required fields and up to four optional ones."""
    properties, required = schema["properties"], set(schema.get("required", []))
    optional = sorted(set(properties) - required)

    def field(name: str) -> st.SearchStrategy:
        return OVERRIDES[name] if name in OVERRIDES else from_schema(openapi, properties[name])

    @st.composite
    def build(draw) -> dict:
        chosen = draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)
                      if optional else st.just([]))
        return {name: draw(field(name)) for name in sorted(required) + chosen}

    return build()


def _integers(openapi: dict, schema: dict) -> st.SearchStrategy:
    """Any integer in range, or (as often) one of the smallest few: token ids in the tiny
    vocabulary, max_tokens within the context; each as often written as a float (`5.0`), which
    JSON Schema counts as an integer too."""
    low, high = schema.get("minimum"), schema.get("maximum")
    start = -4 if low is None else low
    end = start + 40 if high is None else min(high, start + 40)
    integers = st.integers(start, end) | st.integers(low, high)
    return integers | integers.filter(lambda i: abs(i) <= 2**53).map(float)


def _numbers(openapi: dict, schema: dict) -> st.SearchStrategy:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    return st.floats(low, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                     exclude_min=low is not None and "exclusiveMinimum" in schema)


def _strings(openapi: dict, schema: dict) -> st.SearchStrategy:
    if "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    low = schema.get("minLength", 0)
    return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 24), 24)))


def _arrays(openapi: dict, schema: dict) -> st.SearchStrategy:
    low = schema.get("minItems", 0)
    return st.lists(from_schema(openapi, schema.get("items", {})), min_size=low,
                    max_size=max(low, min(schema.get("maxItems", MAX_SIZE), MAX_SIZE)))


def _mappings(openapi: dict, schema: dict) -> st.SearchStrategy:
    values = schema.get("additionalProperties", True)
    keys = _strings(openapi, schema.get("propertyNames", {"maxLength": 8}))
    return st.dictionaries(keys, JSON if values is True else from_schema(openapi, values),
                           max_size=min(schema.get("maxProperties", MAX_SIZE), MAX_SIZE))


SCHEMA_KINDS = {
    "null": lambda openapi, schema: st.none(),
    "boolean": lambda openapi, schema: st.booleans(),
    "integer": _integers,
    "number": _numbers,
    "string": _strings,
    "array": _arrays,
    "object": _mappings,
}


def routed(make: Any) -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(ROUTES).flatmap(lambda route: make(route).map(lambda b: (route, b)))


# --- the fuzz tests ------------------------------------------------------------------------------


@FUZZ
@given(case=routed(lambda route: JSON | st.dictionaries(
    st.sampled_from(sorted(VALID[route])) | st.text(max_size=8), JSON, max_size=4)))
def test_any_json_body_is_answered_without_a_5xx(client, case):
    route, body = case
    check_answer(client, route, post(client, route, json.dumps(body).encode()), body)


@FUZZ
@given(data=st.data())
def test_a_valid_body_with_one_field_replaced_is_answered_without_a_5xx(client, openapi, data):
    route = data.draw(st.sampled_from(ROUTES))
    body = data.draw(one_field_replaced(openapi, route))
    check_answer(client, route, post(client, route, json.dumps(body).encode()), body)


@FUZZ
@given(case=routed(raw_bodies), content_type=CONTENT_TYPES)
def test_raw_and_truncated_bytes_are_answered_without_a_5xx(client, case, content_type):
    route, content = case
    check_answer(client, route, post(client, route, content, content_type), content)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_bodies_from_the_openapi_schema_are_answered_without_a_5xx(client, openapi, data):
    route = data.draw(st.sampled_from(ROUTES))
    body = data.draw(from_schema(openapi, request_schema(openapi, route)), label="body")
    check_answer(client, route, post(client, route, json.dumps(body).encode()), body)


def test_the_server_still_serves_after_fuzzing(client):
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    running = 'aserve:num_requests_running{model_name="tiny"} 0.0'
    deadline = time.monotonic() + 10
    while running not in client.get("/metrics").text:  # nothing left running or stuck
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.05)


# A request's own chat_template runs in jinja2's sandbox; whatever it raises is the request's
# fault. Found by this fuzzer (each answered 500 before chat.py caught every template error).
FAILING_TEMPLATES = {
    "zero_division": "{{ 1 / 0 }}",
    "range_over_the_sandbox_limit": "{% for i in range(10**9) %}{% endfor %}",
}


@pytest.mark.parametrize("template", FAILING_TEMPLATES.values(), ids=FAILING_TEMPLATES.keys())
@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_a_request_chat_template_that_fails_is_a_400(client, route, template):
    body = {"model": MODEL, "messages": USER, "chat_template": template, "max_tokens": 1}
    response = post(client, route, json.dumps(body).encode())
    settled(client)
    assert response.status_code == 400, response.text
    check_error_body(response.json(), 400, response.text)


# --- /openapi.json -------------------------------------------------------------------------------


def test_openapi_json_lists_every_route_of_the_app(app, openapi):
    served = {re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path): route.methods - {"HEAD"}
              for route in app.routes if not isinstance(route, Mount)}  # ({id:path}: {id})
    served |= {f"{route.path}/{{path}}": {"GET"} for route in app.routes
               if isinstance(route, Mount)}  # the web pages' static files
    assert set(openapi["paths"]) == set(served)
    for path, methods in served.items():
        assert {m.upper() for m in openapi["paths"][path]} == methods


def test_openapi_documents_bodies_streams_and_errors(openapi):
    completions = openapi["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]) == {"200", "400", "404", "413", "503"}  # no timeout set
    assert set(completions["responses"]["200"]["content"]) == {"application/json",
                                                               "text/event-stream"}
    error = openapi["components"]["responses"]["BadRequest"]["content"]["application/json"]
    assert resolve(openapi, error["schema"])["required"] == ["error"]
    stop = request_schema(openapi, "/v1/completions")["properties"]["stop"]
    assert {"maxLength": 512, "minLength": 1, "type": "string"} in stop["anyOf"]
    assert "security" not in completions  # no API key


def test_openapi_with_an_api_key_marks_v1_as_secured(model_dir_factory):
    config = ServerConfig(served_model_name=MODEL, api_key="secret", request_timeout=5.0)
    doc = build_openapi(tiny_app(model_dir_factory("llama"), config))
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"bearerAuth": []}]
    assert {"401", "504"} <= set(completions["responses"])
    assert doc["paths"]["/tokenize"]["post"]["security"] == [{"bearerAuth": []}]  # templates
    assert "security" not in doc["paths"]["/health"]["get"]
    assert doc["paths"]["/dashboard/stats"]["get"]["security"] == [{"bearerAuth": []}]


def test_openapi_document_is_a_valid_openapi_3_1_document(openapi):
    from openapi_spec_validator import validate  # in the test extra

    assert openapi["openapi"].startswith("3.1.")
    validate(openapi)  # raises on the first violation of the OpenAPI 3.1 schema
