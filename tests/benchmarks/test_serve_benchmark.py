"""benchmarks/serve.py against a real `python -m aserve` process on the tiny model: every request
completes, the figures are consistent, and the prefix-sharing workload sees prefix-cache hits.
No timing thresholds: only what must hold on any machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.server import free_port, wait_healthy

pytestmark = pytest.mark.spawns  # python -m aserve and benchmarks/serve.py

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def aserve_url(model_dir_factory) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--model", str(model_dir_factory("llama")),
         "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_serve_benchmark(url: str, *args: str, raw: Path | None = None) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--base-url", url,
           "-n", "8", "-o", "8", "--timeout", "60", *args]
    if raw is not None:
        cmd += ["--save-raw", str(raw)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    return json.loads(lines[0])


def test_serve_benchmark_completes_every_request_and_reports_consistent_latencies(
        aserve_url, tmp_path):
    report = run_serve_benchmark(aserve_url, "-i", "16", "--concurrency", "4",
                                 raw=tmp_path / "raw.jsonl")
    assert report["benchmark"] == "serve"
    assert (report["completed"], report["failed"]) == (8, 0)
    assert report["output_tokens"] == 8 * 8  # ignore_eos: every token made, counted by usage
    assert report["output_tokens_per_s"] > 0
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p99"}
    records = [json.loads(line) for line in (tmp_path / "raw.jsonl").read_text().splitlines()]
    assert len(records) == 8
    assert all(r["ok"] and r["output_tokens"] == 8 and r["ttft_s"] <= r["e2e_s"]
               for r in records)


def test_prefix_sharing_workload_reports_prefix_cache_hits(aserve_url):
    report = run_serve_benchmark(aserve_url, "--workload", "prefix-sharing",
                                 "--num-prefixes", "2", "--prefix-len", "64", "-i", "8",
                                 "--concurrency", "2")
    assert (report["completed"], report["failed"]) == (8, 0)
    assert report["prefix_cache_queries"] > 0
    assert report["prefix_cache_hit_rate"] > 0
    assert report["ttft_ms_first_of_prefix"]["p50"] is not None
    assert report["ttft_ms_later"]["p50"] is not None
