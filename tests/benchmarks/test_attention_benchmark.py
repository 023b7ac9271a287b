"""benchmarks/studies/attention.py --chunks: the row-tile kernel and the SDPA path timed on the
same prefill chunks, and their outputs agree (bf16 rounding apart). Structure only: no timing
thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"


@pytest.mark.spawns
def test_chunks_time_both_paths_on_the_same_rows():
    result = subprocess.run(
        [sys.executable, str(STUDIES / "attention.py"), "--chunks", "40:40,100:24",
         "--heads", "4", "--kv-heads", "2", "--head-dim", "64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if report.get("error"):
        pytest.skip(report["error"])  # no AVX-512 kernel build on this machine
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(report["chunks"]) == {"40:40", "100:24"}
    for entry in report["chunks"].values():
        assert entry["tiles"]["ms"] > 0 and entry["sdpa"]["ms"] > 0
        assert entry["max_abs_diff"] < 0.05  # the same attention, two kernels
