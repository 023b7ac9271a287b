"""Disaggregated prefill over HTTP, by hand (what vLLM's toy proxy does): two `python -m aserve`
instances, a producer and a consumer, for each connector.

The producer gets the proxy's request (max_tokens=1, stream=false, kv_transfer_params with
do_remote_decode) and answers kv_transfer_params at the top level of its response; those go
verbatim into the consumer's request, whose text equals the consumer's own answer without
them (a single instance's), while its `aserve:external_prefix_cache_hits` cover most prompt
tokens; afterwards neither side holds a KV block (`aserve:kv_cache_usage_perc`). Bad
kv_transfer_params are a 400 that never reaches the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from helpers.disagg import configs, metric, start, wait_for_no_blocks
from helpers.server import assert_error, free_port, serving, tiny_app, wait_healthy

PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
PROMPT = ("Paged attention keeps the KV cache in fixed-size blocks, like pages of memory, "
          "and continuous batching lets finished requests leave")
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. "
             "Hello! How are you today?"}]


def text_of(body: dict, route: str) -> str:
    choice = body["choices"][0]
    return choice["text"] if route == "completions" else choice["message"]["content"]


def streamed_text(url: str, route: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", f"{url}/v1/{route}", json=dict(body, stream=True),
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    parts.append(choice[0].get("text") or choice[0].get("delta", {}).get(
                        "content") or "")
    return "".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["SharedStorageConnector", "P2pConnector"])
def test_producer_then_consumer_over_http_equals_a_single_instance(model_dir_factory, tmp_path,
                                                                    connector):
    model_dir = model_dir_factory("llama")
    produce, consume = configs(connector, tmp_path)
    ports = free_port(), free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with open(tmp_path / "producer.log", "w") as log_p, open(tmp_path / "consumer.log",
                                                              "w") as log_c:
        procs = [start(model_dir, ports[0], produce, log_p),
                 start(model_dir, ports[1], consume, log_c)]
    try:
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, timeout=120)
        producer, consumer = urls
        num_prompt_tokens = 0
        for route in ("completions", "chat/completions"):
            for stream in (False, True):
                # a prompt of its own each round: none is a prefix hit of an earlier one
                start_text = f"Round {route} {stream}. "
                payload = ({"prompt": start_text + PROMPT} if route == "completions" else
                           {"messages": [{"role": "user",
                                          "content": start_text + MESSAGES[0]["content"]}]})
                body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **payload}
                first = httpx.post(f"{producer}/v1/{route}", timeout=60, json=dict(
                    body, max_tokens=1, stream=False, kv_transfer_params=PROXY_PARAMS))
                assert first.status_code == 200, first.text
                params = first.json()["kv_transfer_params"]
                assert params["do_remote_prefill"] is True and not params["do_remote_decode"]
                num_prompt_tokens += first.json()["usage"]["prompt_tokens"]
                decode_body = dict(body, max_tokens=12, kv_transfer_params=params)
                if stream:
                    text = streamed_text(consumer, route, decode_body)
                else:
                    second = httpx.post(f"{consumer}/v1/{route}", json=decode_body, timeout=60)
                    assert second.status_code == 200, second.text
                    assert second.json()["kv_transfer_params"] is None
                    text = text_of(second.json(), route)
                single = httpx.post(f"{consumer}/v1/{route}", timeout=60,
                                    json=dict(body, max_tokens=12))  # no params: computed here
                assert text == text_of(single.json(), route) and text
        hits = metric(consumer, "external_prefix_cache_hits_total")
        assert hits >= 0.75 * num_prompt_tokens, (hits, num_prompt_tokens)
        assert metric(consumer, "kv_load_failures_total") == 0
        assert metric(consumer, "kv_transfer_bytes_total") > 0
        for url in urls:
            wait_for_no_blocks(url)
        bad = httpx.post(f"{consumer}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hi", "kv_transfer_params": {"remote_what": 1}})
        assert_error(bad, 400, "kv_transfer_params", "does not know")
        bad = httpx.post(f"{consumer}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": ["a", "b"], "kv_transfer_params": {}})
        assert_error(bad, 400, contains="single prompt")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def test_kv_transfer_params_without_a_connector_are_a_400(llama_dir):
    with serving(tiny_app(llama_dir)) as url:
        for route, payload in (("completions", {"prompt": "hi"}),
                               ("chat/completions", {"messages": MESSAGES})):
            response = httpx.post(f"{url}/v1/{route}", timeout=30, json={
                "model": "tiny", **payload, "kv_transfer_params": {"do_remote_decode": True}})
            assert_error(response, 400, "kv_transfer_params", "needs a KV connector")
        streamed = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hi", "stream": True,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert_error(streamed, 400, contains="needs stream=false")
        ok = httpx.post(f"{url}/v1/completions", timeout=30,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["kv_transfer_params"] is None


@pytest.mark.parametrize("config, message", [
    ('{"kv_connector": "NixlConnector"}', "not a connector aserve has"),
    ('{"kv_connector": "P2pConnector", "kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_connector": ', "not valid JSON"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}', "shared_storage_path"),
    ('{"kv_connector": "P2pConnector", "kv_porrt": 1}', "unknown keys ['kv_porrt']"),
])
def test_bad_kv_transfer_config_is_a_clear_startup_error(llama_dir, config, message):
    result = subprocess.run([sys.executable, "-m", "aserve", "--model", str(llama_dir),
                             "--kv-transfer-config", config], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and message in result.stderr, result.stderr
