"""benchmarks/studies/gc_heap.py on the tiny llama: both modes run in one process, the engine
froze its startup heap, and the report has the figures it names. Structure only: no timing
thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spawns
def test_the_report(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "studies" / "gc_heap.py"), "--model",
         str(llama_dir), "--rounds", "1", "-n", "4", "-i", "8", "-o", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == report
    assert report["frozen_objects"] > 1000  # the engine froze what startup left alive
    for mode in ("frozen", "thawed"):
        assert report[mode]["output_tok_s_median"] > 0
        assert report[mode]["max_step_gap_ms"] > 0
        assert report[mode]["full_collections"] >= 0
