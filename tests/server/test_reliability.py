"""Overload, deadlines, liveness, engine death and graceful shutdown: nothing lost, nothing hung.

- beyond `max_num_seqs` running and `max_waiting_requests` waiting, a request is refused at once
  with 503 + Retry-After, and the accepted ones still complete;
- `request_timeout` aborts a request (504, or an error event when streaming) and frees it;
- `/health?generate=1` generates a token, and tells a stuck engine (503) from a healthy one;
- a dead engine makes `python -m aserve` exit non-zero; SIGTERM lets in-flight requests finish
  within `--shutdown-timeout`, aborts the rest with finish_reason "abort", and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers.server import free_port, serving, tiny_app, wait_healthy

from aserve.runner.worker import Worker
from aserve.server import ServerConfig

pytestmark = pytest.mark.spawns  # uvicorn servers, and python -m aserve processes


def body(**extra) -> dict:
    return {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b)
                                      for b in bodies))


def test_past_the_waiting_limit_requests_get_503_retry_after_and_the_rest_complete(
        model_dir_factory):
    config = ServerConfig(served_model_name="tiny", max_waiting_requests=2)
    app = tiny_app(model_dir_factory("llama"), config, max_num_seqs=2)
    with serving(app) as url:
        responses = asyncio.run(post_all(url, [body(max_tokens=64)] * 12))
        accepted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 503]
        assert len(accepted) + len(refused) == 12 and refused and len(accepted) >= 4
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert "overloaded" in r.json()["error"]["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in accepted)
        metrics = httpx.get(f"{url}/metrics").text
        assert f'aserve:request_rejected_total{{model_name="tiny"}} {float(len(refused))}' in (
            metrics)
        assert httpx.post(f"{url}/v1/completions", json=body()).status_code == 200  # drained


def test_request_timeout_aborts_and_frees_the_request(model_dir_factory, monkeypatch):
    real = Worker.execute_model

    def slow(self, scheduler_output):
        time.sleep(0.05)
        return real(self, scheduler_output)

    monkeypatch.setattr(Worker, "execute_model", slow)
    config = ServerConfig(served_model_name="tiny", request_timeout=0.5)
    app = tiny_app(model_dir_factory("llama"), config)
    with serving(app) as url:
        out = httpx.post(f"{url}/v1/completions", json=body(max_tokens=200), timeout=30)
        assert out.status_code == 504 and "timeout" in out.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=body(max_tokens=200, stream=True)) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == 504
        engine = app.state.aserve.engine
        deadline = time.monotonic() + 10
        while (engine.num_requests_in_flight or engine.stats.num_running_reqs) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        assert engine.num_requests_in_flight == 0 and engine.stats.kv_cache_usage == 0
        assert httpx.post(f"{url}/v1/completions", json=body(max_tokens=2)).status_code == 200


def test_liveness_probe_generates_and_reports_a_stuck_engine(model_dir_factory, monkeypatch):
    config = ServerConfig(served_model_name="tiny", liveness_timeout=1.0)
    app = tiny_app(model_dir_factory("llama"), config)
    stuck = threading.Event()
    real = Worker.execute_model

    def maybe_stuck(self, scheduler_output):
        if stuck.is_set():
            time.sleep(3)
        return real(self, scheduler_output)

    monkeypatch.setattr(Worker, "execute_model", maybe_stuck)
    with serving(app) as url:
        assert httpx.get(f"{url}/health?generate=1", timeout=10).status_code == 200
        stuck.set()
        start = time.monotonic()
        probe = httpx.get(f"{url}/health?generate=1", timeout=10)
        assert probe.status_code == 503 and "within 1 s" in probe.json()["error"]["message"]
        assert time.monotonic() - start < 3
        assert httpx.get(f"{url}/health").status_code == 200  # alive, only slow
        stuck.clear()


def start_server(model_dir, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aserve", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny",
         *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigterm_finishes_or_aborts_in_flight_requests_and_exits_0(model_dir_factory):
    """A zero grace period: the long stream is aborted at once, with finish_reason "abort"."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir_factory("llama"), port, "--shutdown-timeout", "0")
    try:
        wait_healthy(proc, url)
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json=body(max_tokens=500, stream=True)) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        long_reader = threading.Thread(target=stream)
        long_reader.start()
        while not events:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        long_reader.join(timeout=10)
        assert events[-1] == "data: [DONE]"
        reasons = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events
                   if e.startswith("data: {") and json.loads(e[6:])["choices"]]
        assert reasons[-1] == "abort", reasons[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_larger_than_all_capacity_is_a_400_not_a_retry(model_dir_factory):
    config = ServerConfig(served_model_name="tiny", max_waiting_requests=2)
    with serving(tiny_app(model_dir_factory("llama"), config, max_num_seqs=2)) as url:
        out = httpx.post(f"{url}/v1/completions", json=body(n=5))
        assert out.status_code == 400 and "retry-after" not in out.headers
        assert out.json()["error"]["param"] == "n"
