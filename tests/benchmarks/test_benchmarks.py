"""The benchmark scripts run end to end on a tiny model and print one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # runs benchmarks/throughput.py (~50 s)

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_benchmark_compares_with_hf(model_dir_factory):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"),
         "--model", str(model_dir_factory("llama")), "-n", "8", "-i", "16", "-o", "8",
         "--compare-hf", "--hf-batch-size", "4"],
        capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["aserve"]["output_tokens_per_s"] > 0
    assert report["hf"]["output_tokens_per_s"] > 0
    expected = report["aserve"]["output_tokens_per_s"] / report["hf"]["output_tokens_per_s"]
    assert abs(report["ratio_vs_hf"] - expected) < 0.01
    assert 0 < report["aserve"]["overhead_fraction"] < 1
    assert report["aserve"]["num_steps"] >= 8  # at least one step per output token
    for engine in ("aserve", "hf"):
        assert report[engine]["num_requests"] == 8
        assert report[engine]["num_output_tokens"] == 8 * 8  # ignore_eos: every token made
