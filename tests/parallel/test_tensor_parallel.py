"""Tensor and pipeline parallelism on CPU (gloo, 2-4 processes): greedy output with TP=2, PP=2
and TP=2 x PP=2 equals transformers' token for token — GQA with more ranks than kv heads, a
vocabulary that does not split evenly, tied embeddings, chunked prefill, prefix-cache hits and
preemption included; the server started with `-tp 2`
answers an OpenAI client and leaves no process behind after SIGTERM; a rank that dies turns
`/health` to 503, fails in-flight requests instead of hanging them, and ends the server process
with exit code 1."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.hf_models import hf_greedy
from helpers.server import free_port, wait_healthy

from aserve import LLM, SamplingParams

NUM_NEW = 16
CASES = {
    "llama": ("llama", {}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}),
    "llama-odd-vocab-tied": ("llama", {"vocab_size": 509, "tie_word_embeddings": True}),
}


LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_greedy_matches_hf(model_dir_factory, case, layout):
    arch, overrides = CASES[case]
    model_dir = model_dir_factory(arch, **overrides)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 16, 33, 50, 9)]
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=24, block_size=4,
             **LAYOUTS[layout]) as llm:
        for _ in range(2):  # the second pass hits the prefix cache
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.stats().prefix_cache_hits > 0


@pytest.mark.slow
def test_tp2_pp2_greedy_matches_hf_under_preemption(model_dir_factory):
    """Four ranks: two stages of two tensor-parallel ranks each; a cache small enough to
    preempt."""
    model_dir = model_dir_factory("llama", num_hidden_layers=3)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 41, 12, 50)]
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(model_dir, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
             num_kv_blocks=11, block_size=8, max_model_len=80) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.stats().num_preemptions > 0


@pytest.mark.parametrize("partition", ["1,2", "2,1"])
def test_pp2_with_an_uneven_layer_partition_matches_hf(model_dir_factory, partition):
    model_dir = model_dir_factory("llama", num_hidden_layers=3)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(model_dir, dtype="float32", pipeline_parallel_size=2,
             pp_layer_partition=partition) as llm:
        runner = llm.engine_core.executor.worker.runner
        assert len(runner.model.attention_layers()) == int(partition[0])  # stage 0's share
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, NUM_NEW)


def test_a_layer_partition_must_match_the_stages():
    from aserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="2 positive layer counts"):
        EngineArgs(model="m", pipeline_parallel_size=2, pp_layer_partition="1,1,1")


def children_of(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in (
        Path(f"/proc/{pid}/status").read_text().lower())


def start_server(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "aserve", "--model", str(model_dir), "--port", str(port),
             "--dtype", "float32", "--max-model-len", "256", "-tp", "2",
             "--served-model-name", "tiny-tp"], stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads process trees from /proc")
def test_server_with_tp2_answers_openai_client_and_sigterm_leaves_no_rank(
        model_dir_factory, tmp_path):
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir_factory("llama"), port, tmp_path / "stderr.log")
    try:
        wait_healthy(proc, url)
        ranks = children_of(proc.pid)
        assert ranks, "no worker rank was spawned"
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.completions.create(model="tiny-tp", prompt="Hello there", max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if alive(pid)], "a rank outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads process trees from /proc")
def test_a_dead_rank_turns_health_503_and_fails_in_flight_requests(model_dir_factory, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir_factory("llama"), port, tmp_path / "stderr.log")
    try:
        wait_healthy(proc, url)
        workers = [pid for pid in children_of(proc.pid)
                   if "aserve" in Path(f"/proc/{pid}/cmdline").read_text()
                   or "multiprocessing" in Path(f"/proc/{pid}/cmdline").read_text()]
        events: list[str] = []
        body = {"model": "tiny-tp", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        while not events:
            time.sleep(0.01)
        for pid in workers:  # the spawned rank (and its helpers): SIGKILL, no goodbye
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 10, "/health still 200 10 s after a rank died"
            time.sleep(0.1)
        reader.join(timeout=20)
        assert not reader.is_alive(), "the in-flight request hangs"
        errors = [json.loads(e[6:]) for e in events if '"error"' in e]
        assert errors and errors[0]["error"]["message"]
        # a dead engine ends the process with a failure, for a supervisor to restart it
        assert proc.wait(timeout=20) == 1
    finally:
        proc.kill()
        proc.wait()


def test_two_nodes_serve_together_and_node_0_stops_node_1(model_dir_factory, tmp_path):
    """Two `python -m aserve` processes as two nodes of one TP=2 engine (one rank each)."""
    model_dir = model_dir_factory("llama")
    port, master_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "256", "-tp",
              "2", "--nnodes", "2", "--master-port", str(master_port)]
    with open(tmp_path / "node1.log", "w") as log1:
        node1 = subprocess.Popen([sys.executable, "-m", "aserve", *common, "--node-rank", "1"],
                                 stdout=subprocess.DEVNULL, stderr=log1)
    with open(tmp_path / "node0.log", "w") as log0:
        node0 = subprocess.Popen([sys.executable, "-m", "aserve", *common, "--port", str(port),
                                  "--served-model-name", "tiny-2n"],
                                 stdout=subprocess.DEVNULL, stderr=log0)
    try:
        wait_healthy(node0, url)
        body = {"model": "tiny-2n", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
                "temperature": 0}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 5
        with LLM(model_dir, dtype="float32") as one:  # the text a single rank writes
            single = one.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True))
        assert out.json()["choices"][0]["text"] == single[0].outputs[0].text
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=30) == 0
        assert node1.wait(timeout=15) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
