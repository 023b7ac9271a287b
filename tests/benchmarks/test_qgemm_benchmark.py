"""benchmarks/studies/qgemm.py --quick: one JSON line with the bf16, int8, int6 and int4 kernels'
times, bytes and rates, and the ratios. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_kernel():
    result = subprocess.run([sys.executable, "benchmarks/studies/qgemm.py", "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = result.stdout.strip().splitlines()
    report = json.loads(line)
    if "skipped" in report:
        return
    assert (report["rows"], report["layers"]) == (1, 2)
    for name in ("bf16", "int8", "int6", "int4"):
        assert report[name]["ms"] > 0 and report[name]["mb"] > 0
    # the packed bytes: int4 (plus its fp16 scales and mins) is under a third of bf16's
    assert report["int4"]["mb"] < report["bf16"]["mb"] / 3 < report["int8"]["mb"]
    assert report["int4"]["mb"] < report["int6"]["mb"] < report["int8"]["mb"]
    assert abs(report["int4_over_bf16"] - report["int4"]["ms"] / report["bf16"]["ms"]) < 0.01
