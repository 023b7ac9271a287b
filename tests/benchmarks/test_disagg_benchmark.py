"""benchmarks/disagg.py --quick end to end: a single instance, then a producer + consumer behind
the proxy, on the tiny llama it builds; one JSON line with both setups' figures, the ratios and
the transfer counters. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.spawns  # the benchmark, three servers per setup
# (P2P only: the other connector's transfers are tested in tests/kv_transfer and
# tests/server; the benchmark's own code is the same for both)
@pytest.mark.parametrize("connector", ["P2pConnector"])
def test_quick_run_reports_both_setups_and_the_transfer(tmp_path, connector):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "disagg.py"), "--quick",
         "--connector", connector, "--workdir", str(tmp_path), "--out", str(tmp_path / "o.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["benchmark"] == "disagg" and report["connector"] == connector
    for setup in ("single", "disagg"):
        (run,) = report["runs"][setup]
        assert run["short_itl_p99_ms"] > 0 and run["long_ttft_p50_ms"] > 0
    transfer = report["runs"]["disagg"][0]["transfer"]
    # the decode side loaded most of each prompt rather than computing it, and nothing failed
    assert transfer["decode"]["loaded_fraction"] >= 0.5
    assert transfer["decode"]["load_failures"] == 0
    assert transfer["prefill"]["bytes"] > 0 and transfer["decode"]["bytes"] > 0
    assert set(report["disagg_over_single"]) >= {"short_itl_p99_ms", "output_tok_s"}
