"""benchmarks/studies/sampling.py --quick: one JSON line with every case of both logit shapes,
each with both samplers' times and their ratio. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"


def test_quick_run_reports_both_samplers_for_every_case():
    sys.path.insert(0, str(STUDIES))
    import sampling

    result = subprocess.run([sys.executable, str(STUDIES / "sampling.py"), "--quick"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["benchmark"] == "sampling" and (report["rows"], report["vocab"]) == (8, 4096)
    assert set(report["cases"]) == {f"{shape}/{case}" for shape in ("peaked", "flat")
                                    for case in sampling.CASES}
    for figures in report["cases"].values():
        device, host = figures["device_style_ms"], figures["host_style_ms"]
        assert device > 0 and host > 0
        assert abs(figures["ratio"] - device / host) <= 0.01 * device / host + 0.006
