"""benchmarks/warmup.py on the tiny llama: one fresh process, two batches; one JSON line with
each batch's figures and the first batch over the steady one. Structure only: no timing
thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spawns
def test_each_process_reports_its_batches(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "warmup.py"), "--model", str(llama_dir),
         "--dtype", "float32", "-n", "4", "-i", "16", "-o", "8", "--processes", "1",
         "--batches", "2", "--llm-kwargs", '{"max_model_len": 64}', "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.strip().splitlines()
    assert out.read_text().strip() == line
    report = json.loads(line)
    (process,) = report["processes"]
    first, second = process["batches"]
    assert first["output_tok_s"] > 0 and second["output_tok_s"] > 0
    assert process["first_over_steady"] == round(first["output_tok_s"] / second["output_tok_s"], 4)
    assert report["first_over_steady_median"] == process["first_over_steady"]
    assert 0 < first["forward_s"] <= first["seconds"]
