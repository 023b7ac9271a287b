"""benchmarks/studies/moe_kernel.py runs end to end on a tiny layer: one JSON line, the fused CPU
MoE and the dense per-expert loop side by side, bit-equal (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spawns, pytest.mark.usefixtures("cpu_gemm_kernel")]

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"


def test_moe_kernel_benchmark_compares_fused_with_the_dense_loop():
    result = subprocess.run(
        [sys.executable, str(STUDIES / "moe_kernel.py"), "--hidden", "64",
         "--intermediate", "96", "--experts", "4", "--top-k", "2", "--layers", "1",
         "--tokens", "1,9"], capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["shape"] == {"hidden": 64, "intermediate": 96, "experts": 4, "top_k": 2,
                               "layers": 1}
    assert set(report["tokens"]) == {"1", "9"}
    for row in report["tokens"].values():
        assert row["bit_equal"] is True
        assert row["fused_ms"] > 0 and row["dense_ms"] > 0
        assert row["ratio"] > 0  # dense / fused, from the unrounded times
