"""`GET /dashboard/stats`: the engine's live figures in one small JSON object, for the dashboard.

Only numbers the engine and the metrics already keep: the scheduler's latest stats, the
counters `/metrics` shows, latency percentiles over recent requests and what the last steps
were made of (the engine thread's `StepLog`). Never a prompt, a reply, a request id or a key.
Rates (tokens per second) are left to the page, from the totals' change between two polls and
`clock_seconds`, as Prometheus' `rate()` does with `/metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aserve.engine.step_log import StepRecord
from aserve.server.errors import ServerError
from aserve.server.serving import server_state

MAX_STEPS = 120  # the most recent steps sent; the dashboard draws one bar each


class Percentiles(BaseModel):
    """Seconds, over the server's last `metrics.RECENT_LATENCIES` samples; None before any."""

    p50: float | None
    p90: float | None
    p99: float | None


class StepComposition(BaseModel):
    """The last steps that computed tokens, oldest first, one entry per step in each list."""

    age_seconds: list[float]  # how long ago each step ended
    prefill_tokens: list[int]  # prompt chunks and recomputation
    decode_tokens: list[int]  # one per request past its prompt
    seconds: list[float]  # the model's time in the step


class DashboardStats(BaseModel):
    model: str
    engine_running: bool
    clock_seconds: float  # a monotonic clock: the time base for rates between two polls
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float  # 0-1, held blocks over all but the null block
    num_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up since start
    prefix_cache_hits: int  # of those, found in the cache
    prefix_cache_hit_rate: float | None  # hits / queries; None before any lookup
    preemptions_total: int
    # Speculative decoding since start: accepted / drafted tokens, and the tokens a verifying
    # step gave on average (its accepted drafts and the one after); None without drafts
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    requests_rejected_total: int
    ttft_seconds: Percentiles
    itl_seconds: Percentiles
    steps: StepComposition


def percentiles(samples: Iterable[float]) -> Percentiles:
    ordered = sorted(samples)
    if not ordered:
        return Percentiles(p50=None, p90=None, p99=None)

    def rank(q: int) -> float:  # nearest rank
        return ordered[(len(ordered) * q - 1) // 100]

    return Percentiles(p50=rank(50), p90=rank(90), p99=rank(99))


def step_composition(steps: list[StepRecord], now: float) -> StepComposition:
    steps = steps[-MAX_STEPS:]
    return StepComposition(age_seconds=[round(now - s[0], 3) for s in steps],
                           prefill_tokens=[s[1] for s in steps],
                           decode_tokens=[s[2] for s in steps],
                           seconds=[round(s[3], 6) for s in steps])


def collect_stats(state) -> DashboardStats:
    """The figures of one app (`ServerState`) whose engine was started (it may have died since:
    the figures stay, with `engine_running` false)."""
    engine = state.engine
    stats = engine.stats
    steps = engine.step_log.snapshot() if engine.step_log is not None else []
    totals = state.metrics.counter_totals()
    now = time.monotonic()
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return DashboardStats(
        model=state.model_name,
        engine_running=engine.is_running,
        clock_seconds=now,
        requests_running=stats.num_running_reqs,
        requests_waiting=stats.num_waiting_reqs,
        kv_cache_usage=stats.kv_cache_usage,
        num_kv_blocks=engine.num_kv_blocks,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries else None,
        preemptions_total=stats.num_preemptions,
        spec_acceptance_rate=(stats.spec_decode_num_accepted_tokens
                              / stats.spec_decode_num_draft_tokens
                              if stats.spec_decode_num_draft_tokens else None),
        spec_mean_accepted_length=(1 + stats.spec_decode_num_accepted_tokens
                                   / stats.spec_decode_num_drafts
                                   if stats.spec_decode_num_drafts else None),
        prompt_tokens_total=int(totals.get("aserve:prompt_tokens_total", 0)),
        generation_tokens_total=int(totals.get("aserve:generation_tokens_total", 0)),
        requests_finished_total=int(totals.get("aserve:request_success_total", 0)),
        requests_rejected_total=int(totals.get("aserve:request_rejected_total", 0)),
        ttft_seconds=percentiles(state.metrics.recent_ttft),
        itl_seconds=percentiles(state.metrics.recent_itl),
        steps=step_composition(steps, now),
    )


async def dashboard_stats(request: Request) -> Response:
    state = server_state(request)
    if state.engine is None:
        raise ServerError("The engine has not started.", 503)
    return JSONResponse(collect_stats(state).model_dump(),
                        headers={"Cache-Control": "no-store"})
