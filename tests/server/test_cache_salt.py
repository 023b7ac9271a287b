"""vLLM's `cache_salt`: a prompt's cached blocks are shared only among requests with the same
salt, so one tenant cannot time another's prompts through the prefix cache."""

from __future__ import annotations

import httpx
import pytest
from helpers.server import assert_error

from aserve import LLM, SamplingParams

pytestmark = pytest.mark.spawns  # a uvicorn server on a port

PROMPT = "The same long system prompt, shared by everyone who calls this server. " * 2


def prefix_cache_hits(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("aserve:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prefix-cache hit counter in /metrics")


def hits_of(url: str, route: str, body: dict) -> float:
    before = prefix_cache_hits(url)
    response = httpx.post(f"{url}{route}", json={"max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return prefix_cache_hits(url) - before


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": PROMPT},
                                           {"role": "user", "content": "Hi"}]}),
])
def test_requests_share_cached_blocks_only_with_the_same_salt(server_url, route, body):
    assert hits_of(server_url, route, {**body, "cache_salt": "tenant-a"}) == 0
    assert hits_of(server_url, route, {**body, "cache_salt": "tenant-b"}) == 0
    assert hits_of(server_url, route, body) == 0  # unsalted: no salt's blocks either
    assert hits_of(server_url, route, {**body, "cache_salt": "tenant-a"}) > 0
    assert hits_of(server_url, route, body) > 0


@pytest.mark.parametrize("salt", ["", "s" * 1025, 5, ["a"]])
def test_a_bad_salt_is_a_400_naming_it(server_url, salt):
    response = httpx.post(f"{server_url}/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 1, "cache_salt": salt})
    assert_error(response, 400, "cache_salt")


def test_offline_prompts_take_the_salt_as_vllm_does(model_dir_factory):
    llm = LLM(str(model_dir_factory("llama")), dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(prompt) -> int:
        return llm.generate(prompt, params)[0].num_cached_tokens

    assert cached({"prompt": PROMPT, "cache_salt": "a"}) == 0
    assert cached({"prompt": PROMPT, "cache_salt": "b"}) == 0
    assert cached({"prompt": PROMPT, "cache_salt": "a"}) > 0
    assert cached(PROMPT) == 0
    ids = llm.get_tokenizer().encode(PROMPT)  # token-id prompts take it too
    assert cached({"prompt_token_ids": ids, "cache_salt": "c"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "c"}) > 0
    assert cached({"prompt_token_ids": ids}) > 0  # unsalted: the first unsalted run's blocks
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": PROMPT, "cache_salt": ""}, params)
