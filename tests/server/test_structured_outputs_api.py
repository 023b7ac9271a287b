"""Structured outputs over HTTP with the real openai SDK, on a served tiny random-weight model
sampling at temperature 1: json_schema replies validate, json_object replies parse, regex
replies fullmatch, choices are among the choices, and vLLM's `guided_*` fields mean what
`structured_outputs` does; the demo model answers a json_schema request with valid JSON; every
bad constraint is a 400 in OpenAI's shape naming the field, before the engine sees it.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from helpers.server import assert_error, serving, tiny_app

from aserve.engine import async_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rating", "open"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a place as JSON."}]


@pytest.fixture(scope="module")
def url(llama_dir):
    with serving(tiny_app(llama_dir)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none")


def test_json_schema_replies_validate_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                  "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, seed=1,
                                         temperature=1.0, max_tokens=120, response_format=fmt)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=2,
                                            temperature=1.0, max_tokens=120,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_replies_parse(client, llama_dir):
    from aserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(llama_dir)
    closing = {str(tokenizer.token_to_id(c)): 4 for c in ('"', "}")}  # strings end sooner
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, seed=3,
                                         temperature=1.0, max_tokens=200, logit_bias=closing,
                                         response_format={"type": "json_object"})
    for choice in out.choices:
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_and_choice_hold_and_guided_fields_agree(client):
    pattern = r"[A-Z][a-z]{2,5} \d{2}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        out = client.completions.create(model="tiny", prompt="Name and age:", n=3, seed=4,
                                        temperature=1.0, max_tokens=30, extra_body=extra)
        assert all(re.fullmatch(pattern, c.text) for c in out.choices), out.choices
    texts = {}
    choices = ["north", "south", "east or west"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=4, seed=5,
                                             temperature=1.0, max_tokens=10, extra_body=extra)
        texts[next(iter(extra))] = [c.message.content for c in out.choices]
        assert all(t in choices for t in texts[next(iter(extra))])
    assert texts["structured_outputs"] == texts["guided_choice"]  # same seed, same meaning


def test_the_demo_model_answers_a_json_schema_request_with_valid_json():
    from openai import OpenAI

    from aserve.assets import DEMO_MODEL_DIR

    with serving(tiny_app(DEMO_MODEL_DIR)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Rate a city."}],
            temperature=0.0, max_tokens=200,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "place", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format.json_schema.schema is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "could not be"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "guided_grammar could not be"),
    ({"guided_choice": []}, None, ""),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "structured_outputs", "one constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "xml"}}, None, ""),
    ({"guided_choice": [str(i) for i in range(10_001)]}, "guided_choice",
     "at most 10000"),
    ({"structured_outputs": {"json": {"enum": ["x" * 1000] * 1100}}}, "structured_outputs.json",
     "characters long as JSON"),
    ({"guided_grammar": "start: " + "|".join(f'"a{i}"' for i in range(30_000))},
     "guided_grammar", "grammar size"),
]


@pytest.mark.parametrize("body, param, contains", BAD)
def test_a_bad_constraint_is_a_400_naming_the_field(url, body, param, contains):
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    if param is None:
        assert_error(response, 400)
    else:
        assert_error(response, 400, param=param, contains=contains)


def test_a_compile_that_takes_too_long_is_a_400_and_blocks_nobody(url, monkeypatch):
    monkeypatch.setattr(async_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 1e-6)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5,
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert_error(response, 400, contains="longer than")
    plain = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3})
    assert plain.status_code == 200


def test_a_constraint_that_crashes_the_compiler_is_a_400_and_the_server_lives_on(url):
    """Rules nested 5,000 deep overflow llguidance's stack: a SIGSEGV, of a compile worker."""
    rules = "\n".join(f'r{i}: "a" r{i + 1}? | "b"' for i in range(5000))
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5,
               "guided_grammar": f'start: r0\n{rules}\nr5000: "z"'}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert_error(response, 400, param="guided_grammar", contains="crashed")
    out = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 5, "guided_choice": ["up", "down"]})
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] in (
        "up", "down")


def test_hundreds_of_choices_are_answered_with_one_of_them(client):
    choices = [f"city number {i}" for i in range(600)]
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=6,
                                         temperature=1.0, max_tokens=20,
                                         extra_body={"guided_choice": choices})
    assert out.choices[0].message.content in choices
