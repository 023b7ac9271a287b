"""Clients that go away abort their requests and give their KV blocks back; a failed engine
turns /health to 503 and fails in-flight requests promptly."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from helpers.server import serving, tiny_app

from aserve import LLM, SamplingParams

pytestmark = pytest.mark.spawns  # a uvicorn server on a port

PROMPTS = ["Hello! How are you?", "The quick brown fox", "中文文本测试：你好", "Emoji 😀🎉"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def wait_until_idle(url: str, timeout: float = 20.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = metric(url, "aserve:num_requests_running")
        usage = metric(url, "aserve:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.05)


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      leave_after: int | None) -> str | None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, chunks = "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None  # closing the stream disconnects this client
    return text


def test_32_streaming_clients_a_third_disconnecting(model_dir_factory):
    model_dir = model_dir_factory("llama")
    max_tokens = 40
    expected = {o.prompt: o.outputs[0].text for o in LLM(str(model_dir), dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))}
    rng = random.Random(0)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.randrange(0, 30) if i % 3 == 0 else None)
            for i in range(32)]
    with serving(tiny_app(model_dir, max_num_seqs=8)) as url:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(
                    stream_text(client, url, prompt, max_tokens, leave)
                    for prompt, leave in plan))

        results = asyncio.run(main())
        for (prompt, leave), text in zip(plan, results):
            if leave is None:
                assert text == expected[prompt]
        assert wait_until_idle(url) == (0, 0)
        assert metric(url, "aserve:num_requests_waiting") == 0


def test_a_non_streaming_client_that_times_out_aborts_its_request(model_dir_factory):
    with serving(tiny_app(model_dir_factory("llama"), max_model_len=512)) as url:
        with pytest.raises(httpx.TimeoutException):  # 500 tokens take well over 0.3 s
            httpx.post(f"{url}/v1/completions", timeout=0.3, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
        assert wait_until_idle(url) == (0, 0)
        ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                        "max_tokens": 3})
        assert ok.status_code == 200


def test_an_engine_failure_turns_health_to_503_and_fails_in_flight(model_dir_factory,
                                                                     monkeypatch):
    from aserve.runner.worker import Worker

    with serving(tiny_app(model_dir_factory("llama"), max_model_len=512)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # generating

            def boom(self, scheduler_output):
                raise RuntimeError("injected failure")

            monkeypatch.setattr(Worker, "execute_model", boom)
            start = time.monotonic()
            while httpx.get(f"{url}/health").status_code != 503:  # DESIGN: within a second
                assert time.monotonic() - start < 1.0, "/health still 200 a second later"
                time.sleep(0.01)
            events = [line for line in lines if line.startswith("data: ")]
        error = json.loads(next(e for e in events if '"error"' in e)[6:])["error"]
        assert error["code"] == 503 and "injected failure" in error["message"]
        assert events[-1] == "data: [DONE]"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "injected failure" in health.json()["error"][
            "message"]
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi"})
        assert refused.status_code == 503
