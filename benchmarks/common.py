"""Helpers shared by the benchmark scripts: the seeded synthetic workload, latency summaries,
Prometheus text parsing and a free loopback port. Plain Python only (no torch, no httpx), so
that every script can import it cheaply."""

from __future__ import annotations

import json
import math
import random
import re
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


def make_prompts(n: int, input_len: int, vocab_size: int, seed: int = 0,
                 first_id: int = 3) -> list[list[int]]:
    """Seeded random token ids, skipping the special ids below `first_id`: the workload of every
    engine (benchmarks/peers/offline_vllm.py sends vLLM the same ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(first_id, vocab_size) for _ in range(input_len)] for _ in range(n)]


def vocab_size_of(model_dir: str | Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated (numpy's
    default method)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_ms(seconds: Iterable[float]) -> dict[str, float | None]:
    """{"mean", "p50", "p99"} in milliseconds of durations given in seconds (None when empty)."""
    values = sorted(s * 1000 for s in seconds)
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": round(sum(values) / len(values), 2),
            "p50": round(percentile(values, 50), 2),
            "p99": round(percentile(values, 99), 2)}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (`name{a="b"} 3` and `name 3` alike)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        totals[match.group(1)] = totals.get(match.group(1), 0.0) + value
    return totals


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def best_time(fn, min_repeats: int = 5, budget_s: float = 0.5) -> float:
    """Best seconds of one call of `fn` (after a warm-up call), of at least `min_repeats` calls
    and as many more as fit in `budget_s` (up to 200): on a busy machine a call stalls now and
    then, and the best one is the one that did not."""
    fn()
    best, start, repeats = float("inf"), time.perf_counter(), 0
    while repeats < min_repeats or (time.perf_counter() - start < budget_s and repeats < 200):
        t0 = time.perf_counter()
        fn()
        best, repeats = min(best, time.perf_counter() - t0), repeats + 1
    return best


def emit(result: dict, out: Path | None) -> None:
    """A benchmark's one JSON line: printed, and written to `out` too when given."""
    line = json.dumps(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    print(line, flush=True)
