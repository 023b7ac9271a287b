"""benchmarks/studies/decoder_stack.py on the tiny llama (bf16): both modes run, their tokens
agree (the script fails otherwise), and the report has the figures it names. Structure only: no
timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"

pytestmark = pytest.mark.usefixtures("cpu_layer_kernel")  # the stack needs aserve's GEMM


@pytest.mark.spawns
def test_the_report(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(STUDIES / "decoder_stack.py"), "--model",
         str(llama_dir), "--batch", "2", "--rounds", "2", "-o", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == report
    for mode in ("stack", "layers"):
        assert report[mode]["ms_per_token"] > 0 and report[mode]["forward_ms_per_step"] > 0
    assert report["layers_over_stack"]["forward"] > 0
