"""Huge prompts: one that cannot fit is refused before it is tokenized (no memory spike, no
stall), and a long one that can is tokenized while the event loop keeps serving others."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app

pytestmark = pytest.mark.spawns  # a uvicorn server on a port

HUGE = "hello world, this is a prompt " * 500_000  # 15 MB: under the 16 MiB body limit


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


class PeakRss:
    """The test process's peak resident memory while inside (the server runs in it)."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_mb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return self.peak - self.base


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
    ("/tokenize", {"prompt": HUGE}, "prompt"),
])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server_url, route, body,
                                                                    param):
    with httpx.Client(timeout=120) as client:
        client.get(f"{server_url}/version")
        with PeakRss() as rss:
            response = client.post(f"{server_url}{route}", json=body)
    assert_error(response, 400, param, contains="characters")
    # the 15 MB body and its parsed copies only; tokenizing it took +2.5 GB
    assert rss.growth_mb < 400, rss.growth_mb


@pytest.fixture(scope="module")
def long_context_url(model_dir_factory) -> Iterator[str]:
    """A tiny model with a 128k context: its longest token is 13 characters, so prompts of up
    to 1.7 M characters may fit and are tokenized."""
    model = model_dir_factory("llama", max_position_embeddings=131072)
    with serving(tiny_app(model, max_model_len=131072, warmup=False)) as url:
        yield url


def test_a_long_prompt_is_tokenized_while_the_loop_keeps_serving(long_context_url):
    text = "The quick brown fox jumps over the lazy dog. " * 33_000  # 1.5 M characters
    result: dict = {}

    def tokenize() -> None:
        result["response"] = httpx.post(f"{long_context_url}/tokenize", json={"prompt": text},
                                        timeout=120)
        result["done"] = time.monotonic()

    worker = threading.Thread(target=tokenize)
    worker.start()
    canaries = []  # when each /version came back while the tokenization ran
    with httpx.Client(timeout=120) as client:
        while worker.is_alive():
            assert client.get(f"{long_context_url}/version").status_code == 200
            canaries.append(time.monotonic())
            time.sleep(0.02)
    worker.join()
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["count"] > 600_000
    # answered all along: a tokenization holding the GIL (or run on the loop) let none through
    # until it ended (~1 s of encode here; 12-20 s for 16 MB before)
    assert len([t for t in canaries if t < result["done"] - 0.05]) >= 5, len(canaries)
