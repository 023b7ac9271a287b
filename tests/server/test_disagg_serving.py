"""Disaggregated serving end to end: a producer and a consumer `python -m aserve` and
`python -m aserve.disagg_proxy` in front of them, on 127.0.0.1, driven by the openai SDK; for
each connector, and the faults: the decode instance gone (the client gets the proxy's error, the
producer's blocks come back after the lease and it keeps serving), the producer gone before the
consumer pulls (the consumer computes the prompt itself, counted, and answers correctly). P2P
instances share their secret through the environment (`helpers.disagg.start`)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from helpers.disagg import configs, metric, start, wait_for_no_blocks
from helpers.server import assert_error, free_port, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.spawns]

PROMPTS = ["Paged attention keeps the KV cache in fixed-size blocks, like pages of memory, and "
           "continuous batching lets finished requests leave while others decode",
           "The quick brown fox jumps over the lazy dog; then it jumps over the lazy dog again, "
           "and once more, for the sake of a longer prompt"]


class Instances:
    """Processes started by a test, each with a log; all stopped at the end."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.procs = tmp_path, {}

    def aserve(self, name: str, model_dir, config: dict) -> str:
        port = free_port()
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        proc = start(model_dir, port, config, log)
        self.procs[name] = (proc, log)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=180)
        return url

    def proxy(self, prefill: str, decode: str) -> str:
        port = free_port()
        log = open(self.tmp_path / "proxy.log", "w")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen([sys.executable, "-m", "aserve.disagg_proxy", "--prefill", prefill,
                                 "--decode", decode, "--port", str(port), "--timeout", "60"],
                                stdout=subprocess.DEVNULL, stderr=log)
        self.procs["proxy"] = (proc, log)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=60)
        return url

    def kill(self, name: str) -> None:
        proc, _ = self.procs[name]
        proc.kill()
        proc.wait(30)

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs.values():
            proc.wait(30)
            log.close()


@pytest.fixture
def instances(tmp_path):
    group = Instances(tmp_path)
    try:
        yield group
    finally:
        group.stop()


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def generate(client, route: str, content: str, stream: bool, max_tokens: int = 10) -> str:
    """A greedy completion (`route` "completions") or chat reply of `content`."""
    kwargs = dict(model="tiny", max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True}, stream=stream)
    if route == "completions":
        out = client.completions.create(prompt=content, **kwargs)
        return "".join(c.choices[0].text for c in out if c.choices) if stream \
            else out.choices[0].text
    out = client.chat.completions.create(messages=[{"role": "user", "content": content}],
                                         **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream \
        else out.choices[0].message.content


CASES = [(route, stream, i) for route in ("completions", "chat") for stream in (False, True)
         for i in range(len(PROMPTS))]


def content(route: str, stream: bool, i: int) -> str:
    """Each case's prompt starts differently: none is a prefix-cache hit of another's."""
    return f"{route} {stream} {i}: {PROMPTS[i]}"


@pytest.mark.parametrize("connector", ["SharedStorageConnector", "P2pConnector"])
def test_the_proxy_serves_what_one_instance_would(model_dir_factory, tmp_path, instances,
                                                  connector):
    model_dir = model_dir_factory("llama")
    produce, consume = configs(connector, tmp_path)
    producer = instances.aserve("producer", model_dir, produce)
    consumer = instances.aserve("consumer", model_dir, consume)
    proxy = instances.proxy(producer, consumer)
    via_proxy, direct = openai_client(proxy), openai_client(producer)

    assert [m.id for m in via_proxy.models.list()] == ["tiny"]
    texts = {case: generate(via_proxy, case[0], content(*case), case[1]) for case in CASES}
    hits = metric(consumer, "external_prefix_cache_hits_total")
    queries = metric(consumer, "external_prefix_cache_queries_total")
    # the consumer loaded most prompt tokens (all but the last of each prompt, at block
    # granularity) and failed no load
    assert hits >= 0.75 * queries > 0, (hits, queries)
    assert metric(consumer, "kv_load_failures_total") == 0
    # the same requests on one instance: the producer without params, whose cached blocks
    # are the ones it computed itself
    for case in CASES:
        single = generate(direct, case[0], content(*case), case[1])
        assert texts[case] == single and single, case
    for url in (producer, consumer):
        wait_for_no_blocks(url)
    # what a client may send: the params the producer answered (a decode request's own answer
    # carries none); params the connector does not know, or on a batch of prompts, are a 400
    first = httpx.post(f"{producer}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "A last one", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    second = httpx.post(f"{consumer}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "A last one", "max_tokens": 2,
        "kv_transfer_params": first["kv_transfer_params"]})
    assert second.status_code == 200 and second.json()["kv_transfer_params"] is None
    if connector == "P2pConnector":  # the params are the producer's, unaltered, or a 400
        altered = {**first["kv_transfer_params"], "remote_port": 1}
        bad = httpx.post(f"{consumer}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "A last one", "kv_transfer_params": altered})
        assert_error(bad, 400, "kv_transfer_params", "not signed")
    bad = httpx.post(f"{consumer}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "hi", "kv_transfer_params": {"remote_what": 1}})
    assert_error(bad, 400, "kv_transfer_params", "does not know")
    bad = httpx.post(f"{consumer}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": ["a", "b"], "kv_transfer_params": {}})
    assert_error(bad, 400, contains="single prompt")
    for url in (producer, consumer):
        wait_for_no_blocks(url)


def test_faults_never_hang_and_lose_nothing(model_dir_factory, tmp_path, instances):
    model_dir = model_dir_factory("llama")
    timeouts = {"lease_timeout_s": 3, "connect_timeout_s": 2, "transfer_timeout_s": 10}
    produce, consume = configs("P2pConnector", tmp_path)
    produce["kv_connector_extra_config"] = consume["kv_connector_extra_config"] = timeouts
    producer = instances.aserve("producer", model_dir, produce)
    consumer = instances.aserve("consumer", model_dir, consume)
    proxy = instances.proxy(producer, consumer)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}

    # 1. The decode instance is gone: the client gets a 503 from the proxy at once; the
    #    producer, which prefilled and holds the prompt's blocks for a pull that never comes,
    #    gives them back after its lease and goes on serving.
    instances.kill("consumer")
    response = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60)
    assert response.status_code == 503, response.text
    assert "no decode instance could be reached" in response.json()["error"]["message"]
    assert httpx.get(f"{proxy}/health", timeout=30).status_code == 503
    wait_for_no_blocks(producer, timeout=30)
    alone = httpx.post(f"{producer}/v1/completions", json=body, timeout=60)
    assert alone.status_code == 200 and alone.json()["choices"][0]["text"]

    # 2. The producer is gone before the consumer pulls: the consumer computes the prompt
    #    itself (a failed load, counted), and its answer is the one it gives without params
    #    (then from its own cached blocks) and the producer's.
    consumer = instances.aserve("consumer2", model_dir, consume)
    first = httpx.post(f"{producer}/v1/completions", timeout=60, json=dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    instances.kill("producer")
    decoded = httpx.post(f"{consumer}/v1/completions", json=dict(body, kv_transfer_params=params),
                         timeout=60)
    assert decoded.status_code == 200, decoded.text
    assert metric(consumer, "kv_load_failures_total") == 1
    assert metric(consumer, "external_prefix_cache_hits_total") == 0
    computed = httpx.post(f"{consumer}/v1/completions", json=body, timeout=60)
    assert decoded.json()["choices"][0]["text"] == computed.json()["choices"][0]["text"]
    assert decoded.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    wait_for_no_blocks(consumer)
