"""benchmarks/quantized.py and benchmarks/perplexity.py on tiny GGUF files of one llama (F16,
Q8_0, Q4_0), without llama.cpp: one JSON line each, every file's aserve figures and the ratios
to the first file (quantized.py); every path's perplexity and the ratios to the float32
reference (perplexity.py). Structure only: no timing thresholds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gguf_models import write_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def gguf_files(model_dir_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = model_dir_factory("llama")
    return [write_gguf(hf_dir, tmp_path / f"tiny.{q}.gguf", q) for q in ("F16", "Q8_0", "Q4_0")]


def run(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    return json.loads(line)


@pytest.mark.spawns
def test_quantized_reports_every_file_beside_the_first(gguf_files):
    report = run(["benchmarks/quantized.py", "--gguf", *map(str, gguf_files), "-i", "8", "-o",
                  "4", "--batch", "2", "--repeats", "1", "--llamacpp-venv", "/nonexistent"])
    assert list(report["files"]) == [p.name for p in gguf_files]
    first = report["files"][gguf_files[0].name]["aserve"]
    assert first["packed_int_mb"] == 0 and first["packed_bf16_mb"] > 0  # F16: the bf16 GEMM
    for path in gguf_files[1:]:
        row = report["files"][path.name]
        assert row["aserve"]["packed_int_mb"] > 0 and "llamacpp" not in row
        assert row["tpot_over_bf16"] == round(row["aserve"]["tpot_ms"] / first["tpot_ms"], 3)
        assert row["c2_over_bf16"] > 0


@pytest.mark.spawns
def test_perplexity_reports_each_path_against_the_reference(gguf_files):
    report = run(["benchmarks/perplexity.py", "--model", str(gguf_files[2]), "--chunks", "2",
                  "--chunk-len", "32"])
    assert report["reference"]["tokens"] == 2 * 31
    for path in ("bf16", "quantized"):
        ppl = report[path]["perplexity"]
        assert math.isfinite(ppl) and ppl > 1
        assert report[path]["ratio"] == round(ppl / report["reference"]["perplexity"], 4)
