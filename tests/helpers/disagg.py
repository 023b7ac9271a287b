"""Disaggregated prefill in tests: a KV producer in a process of its own (`ProducerProcess`), for
tests whose producer and consumer both run several ranks (one process holds only one default
process group, so a tensor-parallel producer and consumer cannot share the test's process); and
for the HTTP tests, `python -m aserve` instances with a connector (`start`, `configs`) and what
their /metrics say (`metric`, `wait_for_no_blocks`). P2P instances share `KV_SECRET`: offline
in `kv_connector_extra_config.secret`, over HTTP in the environment (`ASERVE_KV_SECRET`), as an
operator would."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import subprocess
import sys
import time

import httpx

from aserve import LLM, SamplingParams
from helpers.server import free_port

KV_SECRET = "aserve-tests-kv-secret-5f0c2a9e"


def _produce(model_dir: str, llm_kwargs: dict, prompts: list[list[int]],
             out: multiprocessing.Queue) -> None:
    with LLM(model_dir, **llm_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=1,
                                              kv_transfer_params={"do_remote_decode": True}))
        out.put([o.kv_transfer_params for o in outputs])
        done = llm.wait_for_kv_transfers(timeout=120)
        out.put((done, llm.stats().kv_cache_usage))


class ProducerProcess:
    """Starts an `LLM(model_dir, **llm_kwargs)` in a spawned process that prefills `prompts`
    (one token each, do_remote_decode); `params()` are its kv_transfer_params; `finish()`
    waits until it has seen every block pulled (or given up) and returns (all transferred,
    its KV cache usage then)."""

    def __init__(self, model_dir, llm_kwargs: dict, prompts: list[list[int]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.queue = context.Queue()
        self.process = context.Process(target=_produce, name="kv-producer",
                                       args=(str(model_dir), llm_kwargs, prompts, self.queue))
        self.process.start()

    def _get(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the producer process said nothing within {timeout} s "
                                 f"(exit code {self.process.exitcode})") from None

    def params(self, timeout: float = 180) -> list[dict]:
        return self._get(timeout)

    def finish(self, timeout: float = 180) -> tuple[bool, float]:
        result = self._get(timeout)
        self.process.join(60)
        return result

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


# ---------------------------------------------------------------------------------- over HTTP

def start(model_dir, port: int, config: dict, log) -> subprocess.Popen:
    """An instance with `config`; a P2P one gets `KV_SECRET` in its environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "aserve", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--max-model-len", "256", "--block-size", "4",
         "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(config)],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "ASERVE_KV_SECRET": KV_SECRET})


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^aserve:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"no aserve:{name} in /metrics"
    return float(match.group(1))


def wait_for_no_blocks(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, f"{url} still holds KV blocks"
        time.sleep(0.1)


def configs(connector: str, tmp_path) -> tuple[dict, dict]:
    if connector == "P2pConnector":
        return ({"kv_connector": connector, "kv_role": "kv_producer", "kv_port": free_port()},
                {"kv_connector": connector, "kv_role": "kv_consumer", "kv_port": free_port()})
    extra = {"shared_storage_path": str(tmp_path / "store")}
    return tuple({"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
                 for role in ("kv_producer", "kv_consumer"))
