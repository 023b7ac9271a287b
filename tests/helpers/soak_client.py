"""The soak test's load: a seeded plan of completion requests and the asyncio clients that send
it over HTTP, some of them going away early. No assertions here: `test_soak.py` checks the
results.

A request streams or not; a streaming client may close its connection after some events, a
non-streaming one may be cancelled after some time. Either way the client disconnects, which is
how an HTTP client aborts a request.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens


@dataclass(frozen=True)
class SoakRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    stream: bool
    leave_after_events: int | None = None  # streaming: disconnect after this many events
    cancel_after_s: float | None = None  # non-streaming: cancel the call after this long

    @property
    def key(self) -> tuple[tuple[int, ...], int]:
        """What its greedy result depends on."""
        return self.prompt, self.max_tokens

    def body(self) -> dict:
        return {"prompt": list(self.prompt), "max_tokens": self.max_tokens, "n": self.n,
                "temperature": 0, "ignore_eos": True, "stream": self.stream}


@dataclass
class SoakResult:
    request: SoakRequest
    aborted: bool = False  # the client went away before the response was complete
    status: int | None = None
    texts: list[str] = field(default_factory=list)  # per choice (partial when aborted)
    finish_reasons: list[str | None] = field(default_factory=list)
    num_completion_tokens: int | None = None  # usage, non-streaming only
    num_events: int = 0


def make_plan(rng: random.Random, num_requests: int, max_model_len: int, vocab_size: int, *,
              max_tokens: int = 24, max_n: int = 3, stream_share: float = 0.5,
              disconnect_share: float = 0.1, cancel_share: float = 0.05,
              num_prefixes: int = 8, start: int = 0) -> list[SoakRequest]:
    """Random prompts (half of them on one of a few shared prefixes, so the prefix cache hits),
    lengths, `max_tokens` and `n`; a share of the streams disconnect early, a share of the other
    requests are cancelled."""
    prefixes = [random_ids(rng, rng.randint(4, max_model_len // 3), vocab_size)
                for _ in range(num_prefixes)]
    plan = []
    for index in range(start, start + num_requests):
        num_tokens = rng.randint(1, max_tokens)
        prefix = rng.choice(prefixes) if rng.random() < 0.5 else ()
        num_suffix = rng.randint(1 if not prefix else 0, max_model_len - num_tokens - len(prefix))
        prompt = prefix + random_ids(rng, num_suffix, vocab_size)
        n = rng.randint(1, max_n)
        stream = rng.random() < stream_share
        leave = cancel = None
        if stream and rng.random() < disconnect_share / stream_share:
            leave = rng.randrange(n * num_tokens)  # 0: right after the response headers
        elif not stream and rng.random() < cancel_share / (1 - stream_share):
            cancel = rng.uniform(0.0, 0.3)
        plan.append(SoakRequest(index, prompt, num_tokens, n, stream, leave, cancel))
    return plan


def random_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(num_tokens))


async def send_all(url: str, plan: Sequence[SoakRequest], concurrency: int) -> list[SoakResult]:
    """Send every request of `plan`, `concurrency` at a time; results in plan order."""
    pending = iter(plan)
    results: dict[int, SoakResult] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for request in pending:
                results[request.index] = await send_one(client, request)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [results[r.index] for r in plan]


async def send_one(client: httpx.AsyncClient, request: SoakRequest) -> SoakResult:
    result = SoakResult(request, texts=[""] * request.n, finish_reasons=[None] * request.n)
    if request.stream:
        await _stream(client, request, result)
        return result
    try:
        response = await asyncio.wait_for(client.post("/v1/completions", json=request.body()),
                                          request.cancel_after_s)
    except asyncio.TimeoutError:  # the connection is closed: the server sees a disconnect
        result.aborted = True
        return result
    result.status = response.status_code
    if response.status_code == 200:
        payload = response.json()
        for choice in payload["choices"]:
            result.texts[choice["index"]] = choice["text"]
            result.finish_reasons[choice["index"]] = choice["finish_reason"]
        result.num_completion_tokens = payload["usage"]["completion_tokens"]
    return result


async def _stream(client: httpx.AsyncClient, request: SoakRequest, result: SoakResult) -> None:
    async with client.stream("POST", "/v1/completions", json=request.body()) as response:
        result.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return
        async for event in _events(response.aiter_lines()):
            if request.leave_after_events is not None and (
                    result.num_events >= request.leave_after_events):
                result.aborted = True
                return  # leaving the block closes the connection mid-stream
            result.num_events += 1
            if "error" in event:
                result.status = event["error"].get("code", 500)
                continue
            for choice in event["choices"]:
                result.texts[choice["index"]] += choice["text"]
                if choice["finish_reason"] is not None:
                    result.finish_reasons[choice["index"]] = choice["finish_reason"]


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    async for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])
