"""Integer fields take whole numbers written as floats: JSON Schema, and so the `/openapi.json`
the server publishes, counts `5.0` (or `5e0`) as the integer 5, so every integer field of every
request model reads it as the int 5 and a request so written is answered as with ints. `5.5`,
`true`, `"5"`, inf and nan are still 400s naming the field, and bounds apply to the int: `1e20`
is answered exactly as `100000000000000000000` is."""

from __future__ import annotations

import json
import math
from operator import attrgetter
from typing import Any

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema

from aserve.server.errors import validation_error_response
from aserve.server.openapi import component_schemas
from aserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

USER = [{"role": "user", "content": "Hi"}]
BASES = {  # a valid body of each route, generating one token
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": USER, "max_tokens": 1},
    "/tokenize": {"model": "tiny", "prompt": "Hi"},
    "/detokenize": {"model": "tiny", "tokens": [5]},
}
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def plain(route: str, name: str, **needs: Any) -> tuple:
    """The integer field `name` (with the other fields it `needs` to be valid)."""
    return route, lambda x: needs | {name: x}, attrgetter(name), name


def second_item(route: str, name: str) -> tuple:
    """The second item of the list of ints `name`."""
    return route, lambda x: {name: [5, x]}, lambda r: getattr(r, name)[1], f"{name}.1"


# id: (route, the fields that put x in the field (the field last), x read back from the parsed
# request, the param of a 400)
INTEGER_FIELDS = {
    "completions.n": plain(COMPLETIONS, "n"),
    "completions.max_tokens": plain(COMPLETIONS, "max_tokens"),
    "completions.min_tokens": plain(COMPLETIONS, "min_tokens", max_tokens=16),
    "completions.priority": plain(COMPLETIONS, "priority"),
    "completions.seed": plain(COMPLETIONS, "seed"),
    "completions.top_k": plain(COMPLETIONS, "top_k"),
    "completions.logprobs": plain(COMPLETIONS, "logprobs"),
    "completions.prompt_logprobs": plain(COMPLETIONS, "prompt_logprobs"),
    "completions.best_of": plain(COMPLETIONS, "best_of", n=5),
    "completions.stop_token_ids": second_item(COMPLETIONS, "stop_token_ids"),
    # A prompt's shape is checked (and named) as a whole: the param is "prompt".
    "completions.prompt_token_ids": (COMPLETIONS, lambda x: {"prompt": [5, x]},
                                     lambda r: r.prompt[1], "prompt"),
    "completions.prompt_batch_token_ids": (COMPLETIONS, lambda x: {"prompt": [[5], [5, x]]},
                                           lambda r: r.prompt[1][1], "prompt"),
    "chat.n": plain(CHAT, "n"),
    "chat.max_tokens": plain(CHAT, "max_tokens"),
    "chat.max_completion_tokens": plain(CHAT, "max_completion_tokens"),
    "chat.min_tokens": plain(CHAT, "min_tokens", max_tokens=16),
    "chat.priority": plain(CHAT, "priority"),
    "chat.seed": plain(CHAT, "seed"),
    "chat.top_k": plain(CHAT, "top_k"),
    "chat.top_logprobs": plain(CHAT, "top_logprobs", logprobs=True),
    "chat.prompt_logprobs": plain(CHAT, "prompt_logprobs"),
    "chat.stop_token_ids": second_item(CHAT, "stop_token_ids"),
    "detokenize.tokens": second_item("/detokenize", "tokens"),
}
NOT_INTEGERS = {"fraction": 5.5, "true": True, "string": "5", "inf": math.inf, "nan": math.nan}


def parse(route: str, fields: dict) -> Any:
    return MODELS[route].model_validate_json(json.dumps(BASES[route] | fields))


@pytest.mark.parametrize("route, fields, read, param", INTEGER_FIELDS.values(),
                         ids=INTEGER_FIELDS.keys())
@pytest.mark.parametrize("whole", [5.0, 5e0, 0.5e1], ids=["5.0", "5e0", "0.5e1"])
def test_a_whole_float_is_read_as_the_int(route, fields, read, param, whole):
    as_float, as_int = parse(route, fields(whole)), parse(route, fields(5))
    assert read(as_float) == 5 and type(read(as_float)) is int
    assert as_float == as_int


def bad_request(route: str, fields: dict) -> dict:
    with pytest.raises(ValidationError) as info:
        parse(route, fields)
    response = validation_error_response(info.value)
    assert response.status_code == 400
    return json.loads(response.body)["error"]


@pytest.mark.parametrize("route, fields, read, param", INTEGER_FIELDS.values(),
                         ids=INTEGER_FIELDS.keys())
@pytest.mark.parametrize("value", NOT_INTEGERS.values(), ids=NOT_INTEGERS.keys())
def test_a_non_integer_is_still_a_400_naming_the_field(route, fields, read, param, value):
    error = bad_request(route, fields(value))
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert ("prompt must" if param == "prompt" else "valid integer") in error["message"]


@pytest.mark.parametrize("name", ["priority", "seed"])
@pytest.mark.parametrize("value", [1e20, -1e20, 2.0**63])
def test_a_whole_float_out_of_int64_range_is_a_400(name, value):
    error = bad_request(COMPLETIONS, {name: value})
    assert error["param"] == name and "than or equal to" in error["message"]


def _integer_properties() -> set[tuple[str, str]]:
    """(model, field) of every property of the request models, nested ones included, whose
    schema holds an integer."""
    _, schemas = models_json_schema([(m, "validation") for m in MODELS.values()])
    return {(model, name) for model, schema in schemas["$defs"].items()
            for name, prop in schema.get("properties", {}).items()
            if '"integer"' in json.dumps(prop)}


def test_the_cases_cover_every_integer_field_of_every_request():
    covered = {(MODELS[route].__name__, list(fields(0))[-1])
               for route, fields, _, _ in INTEGER_FIELDS.values()}
    assert covered == _integer_properties()


def _integer_schemas(schema: Any) -> list[dict]:
    if isinstance(schema, list):
        return [s for item in schema for s in _integer_schemas(item)]
    if not isinstance(schema, dict):
        return []
    own = [schema] if schema.get("type") == "integer" else []
    return own + [s for value in schema.values() for s in _integer_schemas(value)]


def test_the_schema_still_says_integer_with_json_schema_bounds():
    integers = _integer_schemas(component_schemas()[1])
    assert integers and all(s["type"] == "integer" for s in integers)
    # Pydantic writes its own "ge"/"le" where a validator sits between a bound and the int.
    allowed = {"type", "minimum", "maximum", "title", "default", "description"}
    assert all(set(s) <= allowed for s in integers), [s for s in integers if set(s) - allowed]
    assert {"minimum": 1, "type": "integer"} in integers  # max_tokens, for one


# --- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(model_dir_factory):
    with serving(tiny_app(model_dir_factory("llama"), max_model_len=64)) as url:
        yield url


def post(url: str, route: str, fields: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", content=json.dumps(BASES[route] | fields),
                      headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.spawns
@pytest.mark.parametrize("route, fields, read, param", INTEGER_FIELDS.values(),
                         ids=INTEGER_FIELDS.keys())
def test_1e20_is_answered_as_the_int_it_is(server_url, route, fields, read, param):
    as_float = post(server_url, route, fields(1e20))
    assert_error(as_float, 400)
    assert as_float.json() == post(server_url, route, fields(10**20)).json()


WHOLE_FLOAT_REQUESTS = {
    "completion": (COMPLETIONS, {"prompt": [5, 6, 7], "n": 2, "max_tokens": 3, "min_tokens": 3,
                                 "seed": 7, "top_k": 5, "logprobs": 2, "prompt_logprobs": 1,
                                 "best_of": 2, "priority": 1, "stop_token_ids": [0]}),
    "chat": (CHAT, {"max_completion_tokens": 3, "seed": 7, "top_k": 5, "logprobs": True,
                    "top_logprobs": 2}),
    "detokenize": ("/detokenize", {"tokens": [5, 6, 7]}),
}


def _mapped(value: Any, kind: type, change: Any) -> Any:
    """`value` (JSON) with `change` applied to every item of exactly type `kind`."""
    if isinstance(value, list):
        return [_mapped(v, kind, change) for v in value]
    if isinstance(value, dict):
        return {k: _mapped(v, kind, change) for k, v in value.items()}
    return change(value) if type(value) is kind else value


def _answer(response: httpx.Response) -> dict:
    """The body but its id and time, logprobs to 3 places (a prefix-cache hit may change the
    last float32 bits)."""
    assert response.status_code == 200, response.text
    body = {k: v for k, v in response.json().items() if k not in ("id", "created")}
    return _mapped(body, float, lambda x: round(x, 3))


@pytest.mark.spawns
@pytest.mark.parametrize("route, fields", WHOLE_FLOAT_REQUESTS.values(),
                         ids=WHOLE_FLOAT_REQUESTS.keys())
def test_a_request_in_whole_floats_is_answered_as_with_ints(server_url, route, fields):
    as_floats = post(server_url, route, _mapped(fields, int, float))
    assert _answer(as_floats) == _answer(post(server_url, route, fields))
