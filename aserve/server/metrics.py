"""Prometheus metrics under the names vLLM users' dashboards know, prefixed `aserve:` and again
`vllm:` (the same families, so that vLLM's Grafana dashboards and alerts find them unchanged).

Engine gauges and totals (running, waiting, KV-cache usage, prefix-cache queries and hits,
preemptions; with a KV connector, its queries and hits, failed loads, bytes and seconds moved;
with speculative decoding, drafts verified and accepted, also by position)
are read from the engine's latest published stats when scraped; request metrics
(tokens, finishes, TTFT, inter-token and end-to-end latency) are recorded by the routes through a
`RequestTracker`. Each app has its own registry, so several apps can live in one process. The
tracker also keeps the last `RECENT_LATENCIES` TTFT and inter-token samples, from which the
dashboard reads live percentiles (a histogram's buckets are too coarse, and cover all time).
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from aserve.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RECENT_LATENCIES = 1000  # samples of each latency kept for the dashboard's percentiles
VLLM_PREFIX = b"vllm:"  # every family is also rendered under vLLM's prefix


class _EngineStatsCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        engine, name = self.metrics.engine, [self.metrics.model_name]
        stats = engine.stats if engine is not None else None
        for metric, doc, value in (
            ("num_requests_running", "Requests in the running batch.",
             stats.num_running_reqs if stats else 0),
            ("num_requests_waiting", "Requests waiting to be scheduled.",
             stats.num_waiting_reqs if stats else 0),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
             stats.kv_cache_usage if stats else 0.0),
            ("num_requests_waiting_for_remote_kvs", "Requests whose KV the connector loads.",
             stats.num_waiting_for_remote_kvs if stats else 0),
        ):
            family = GaugeMetricFamily(f"aserve:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            yield family
        for metric, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries if stats else 0),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits if stats else 0),
            ("num_preemptions", "Requests preempted (to be recomputed).",
             stats.num_preemptions if stats else 0),
            ("external_prefix_cache_queries", "Prompt tokens asked of the KV connector.",
             stats.external_prefix_cache_queries if stats else 0),
            ("external_prefix_cache_hits", "Prompt tokens loaded from the KV connector.",
             stats.external_prefix_cache_hits if stats else 0),
            ("kv_load_failures", "Requests whose KV load failed (or was given up) and that "
             "were computed here instead.", stats.num_kv_load_failures if stats else 0),
            ("kv_transfer_bytes", "KV bytes the connector moved (loaded and saved or sent), "
             "over all ranks.", stats.kv_transfer_bytes if stats else 0),
            ("kv_transfer_seconds", "Seconds the connector spent moving KV, over all ranks.",
             stats.kv_transfer_seconds if stats else 0.0),
            ("spec_decode_num_drafts", "Speculative decoding: a request's steps that "
             "verified drafts.", stats.spec_decode_num_drafts if stats else 0),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
             stats.spec_decode_num_draft_tokens if stats else 0),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
             stats.spec_decode_num_accepted_tokens if stats else 0),
        ):
            family = CounterMetricFamily(f"aserve:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            yield family
        family = CounterMetricFamily(
            "aserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their position in the draft.",
            labels=["model_name", "position"])
        for position, value in enumerate(
                stats.spec_decode_num_accepted_tokens_per_pos if stats else ()):
            family.add_metric([*name, str(position)], value)
        yield family


class RequestTracker:
    """Times one request; call `on_tokens` as outputs arrive and `on_finish` at the end."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = self.last = time.monotonic()
        self.first_token_seen = False
        metrics.prompt_tokens.labels(metrics.model_name).inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now, m = time.monotonic(), self.metrics
        if not self.first_token_seen:
            m.ttft.labels(m.model_name).observe(now - self.arrival)
            m.recent_ttft.append(now - self.arrival)
            self.first_token_seen = True
        else:
            m.itl.labels(m.model_name).observe(now - self.last)
            m.recent_itl.append(now - self.last)
        self.last = now
        m.generation_tokens.labels(m.model_name).inc(num_tokens)

    def on_finish(self, finish_reason: str | None) -> None:
        m = self.metrics
        m.e2e.labels(m.model_name).observe(time.monotonic() - self.arrival)
        m.request_success.labels(m.model_name, finish_reason or "abort").inc()


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: AsyncEngine | None = None
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("aserve:prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=r)
        self.generation_tokens = Counter("aserve:generation_tokens", "Tokens generated.",
                                         labels, registry=r)
        self.request_success = Counter("aserve:request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("aserve:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("aserve:inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("aserve:e2e_request_latency_seconds", "Request latency.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("aserve:request_rejected", "Requests refused as overload "
                                "(503 + Retry-After).", labels, registry=r)
        r.register(_EngineStatsCollector(self))
        self.recent_ttft: deque[float] = deque(maxlen=RECENT_LATENCIES)
        self.recent_itl: deque[float] = deque(maxlen=RECENT_LATENCIES)

    def bind_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def on_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens)

    def render(self) -> bytes:
        """The exposition text, each family under `aserve:` and then under `vllm:`."""
        text = generate_latest(self.registry)
        return text + text.replace(b"aserve:", VLLM_PREFIX)

    def counter_totals(self) -> dict[str, float]:
        """The counters `/metrics` shows now, by sample name (`aserve:generation_tokens_total`),
        each summed over its labels (`request_success` over finish reasons)."""
        totals: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type != "counter":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals
