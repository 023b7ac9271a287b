"""The limits on what one request may ask (protocol.py's MAX_* constants, and the body size):
one past a limit is a 400 in OpenAI's error shape naming the field (413 for the body), at the
limit is accepted, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app

from aserve.server import ServerConfig
from aserve.server.fields import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOTAL_CHOICES,
)
from aserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

BODY_LIMIT = 1 << 20
USER = [{"role": "user", "content": "Hi"}]
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 1}


def parts(num: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "a"}] * num}]


def bias(num: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(num)}


# id: (route, fields over a valid body, param, words of the message)
OVER_LIMITS = {
    "n": ("/v1/completions", {"n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
    "chat_n": ("/v1/chat/completions", {"n": MAX_N + 1}, "n", str(MAX_N)),
    "prompts": ("/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt",
                f"at most {MAX_PROMPTS} prompts"),
    "token_prompts": ("/v1/completions", {"prompt": [[5]] * (MAX_PROMPTS + 1)}, "prompt",
                      f"at most {MAX_PROMPTS} prompts"),
    "n_times_prompts": ("/v1/completions",
                        {"prompt": ["a"] * (MAX_TOTAL_CHOICES // MAX_N + 1), "n": MAX_N},
                        "prompt", f"at most {MAX_TOTAL_CHOICES}"),
    "stop_strings": ("/v1/completions", {"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop",
                     f"at most {MAX_STOP_STRINGS} strings"),
    "stop_length": ("/v1/completions", {"stop": "a" * (MAX_STOP_CHARS + 1)}, "stop",
                    f"at most {MAX_STOP_CHARS} characters"),
    "stop_length_in_list": ("/v1/chat/completions", {"stop": ["a", "b" * (MAX_STOP_CHARS + 1)]},
                            "stop", f"at most {MAX_STOP_CHARS} characters"),
    "logit_bias": ("/v1/completions", {"logit_bias": bias(MAX_LOGIT_BIAS + 1)}, "logit_bias",
                   f"at most {MAX_LOGIT_BIAS} items"),
    "logit_bias_key": ("/v1/completions", {"logit_bias": {"7" * (MAX_TOKEN_ID_DIGITS + 1): 1}},
                       "logit_bias", "token ids"),
    "stop_token_ids": ("/v1/chat/completions", {"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)},
                       "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} items"),
    "messages": ("/v1/chat/completions", {"messages": USER * (MAX_CHAT_MESSAGES + 1)},
                 "messages", f"at most {MAX_CHAT_MESSAGES} items"),
    "tokenize_messages": ("/tokenize", {"messages": USER * (MAX_CHAT_MESSAGES + 1)}, "messages",
                          f"at most {MAX_CHAT_MESSAGES} items"),
    "content_parts": ("/v1/chat/completions", {"messages": parts(MAX_CONTENT_PARTS + 1)},
                      "messages.0.content", f"at most {MAX_CONTENT_PARTS} parts"),
    "priority": ("/v1/completions", {"priority": 2**63}, "priority", "less than or equal"),
    "seed": ("/v1/completions", {"seed": -(2**63) - 1}, "seed", "greater than or equal"),
    "min_tokens_over_max_tokens": ("/v1/completions", {"min_tokens": 2, "max_tokens": 1},
                                   "min_tokens", "max_tokens=1"),
    "cache_salt": ("/v1/chat/completions", {"cache_salt": "s" * 1025}, "cache_salt",
                   "at most 1024 characters"),
}
BASES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT,
         "/tokenize": {"model": "tiny"}}


@pytest.fixture(scope="module")
def server_url(model_dir_factory):
    config = ServerConfig(served_model_name="tiny", max_request_body_bytes=BODY_LIMIT)
    with serving(tiny_app(model_dir_factory("llama"), config, max_model_len=64)) as url:
        yield url


@pytest.mark.spawns
@pytest.mark.parametrize("route, fields, param, words", OVER_LIMITS.values(),
                         ids=OVER_LIMITS.keys())
def test_one_past_a_limit_is_a_400_naming_the_field(server_url, route, fields, param, words):
    response = httpx.post(f"{server_url}{route}", json=BASES[route] | fields, timeout=30)
    assert_error(response, 400, param, contains=words)


# id: (request model, body exactly at the limits)
AT_LIMITS = {
    "n": (CompletionRequest, COMPLETION | {"n": MAX_N}),
    "prompts": (CompletionRequest, COMPLETION | {"prompt": ["a"] * MAX_PROMPTS}),
    "n_times_prompts": (CompletionRequest, COMPLETION | {
        "prompt": [[5]] * (MAX_TOTAL_CHOICES // MAX_N), "n": MAX_N}),
    "stop": (CompletionRequest, COMPLETION | {"stop": ["a" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}),
    "logit_bias": (CompletionRequest, COMPLETION | {"logit_bias": bias(MAX_LOGIT_BIAS)}),
    "logit_bias_key": (CompletionRequest, COMPLETION | {
        "logit_bias": {"0" * MAX_TOKEN_ID_DIGITS: 1}}),
    "stop_token_ids": (ChatCompletionRequest, CHAT | {
        "stop_token_ids": [5] * MAX_STOP_TOKEN_IDS}),
    "messages": (ChatCompletionRequest, CHAT | {"messages": USER * MAX_CHAT_MESSAGES}),
    "tokenize_messages": (TokenizeRequest, {"messages": USER * MAX_CHAT_MESSAGES}),
    "content_parts": (ChatCompletionRequest, CHAT | {"messages": parts(MAX_CONTENT_PARTS)}),
    "priority": (CompletionRequest, COMPLETION | {"priority": 2**63 - 1}),
}


@pytest.mark.parametrize("cls, body", AT_LIMITS.values(), ids=AT_LIMITS.keys())
def test_a_request_at_the_limits_is_valid(cls, body):
    cls.model_validate_json(json.dumps(body))


@pytest.mark.spawns
def test_the_largest_n_and_stop_list_generate(server_url):
    body = COMPLETION | {"n": MAX_N, "stop": ["zz" * (MAX_STOP_CHARS // 2)] * MAX_STOP_STRINGS,
                         "ignore_eos": True, "seed": 1}
    response = httpx.post(f"{server_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_N


def padded(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes."""
    empty = json.dumps(COMPLETION | {"user": ""}).encode()
    return json.dumps(COMPLETION | {"user": "x" * (size - len(empty))}).encode()


def chunks(body: bytes, size: int = 4096):
    for start in range(0, len(body), size):
        yield body[start:start + size]


@pytest.mark.spawns
def test_a_body_at_the_size_limit_is_served(server_url):
    response = httpx.post(f"{server_url}/v1/completions", content=padded(BODY_LIMIT))
    assert response.status_code == 200, response.text


@pytest.mark.spawns
@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_a_body_over_the_size_limit_is_a_413(server_url, chunked):
    body = padded(BODY_LIMIT + 1)
    content = chunks(body) if chunked else body  # an iterator is sent without Content-Length
    response = httpx.post(f"{server_url}/v1/completions", content=content)
    assert_error(response, 413, None, contains=f"larger than {BODY_LIMIT} bytes")


@pytest.mark.spawns
def test_the_server_still_serves_after_refusals(server_url):
    assert httpx.get(f"{server_url}/health").status_code == 200
    ok = httpx.post(f"{server_url}/v1/completions",
                    json=COMPLETION | {"max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
