"""benchmarks/roofline.py on the tiny llama (bf16), without llama.cpp: the bandwidth, the weight
bytes a batch-1 step reads (checked against the checkpoint's own tensors), aserve's TPOT from
its step log, the fraction, and a profiled request. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import roofline  # noqa: E402


def test_weight_bytes_are_the_checkpoints_tensors(llama_dir):
    from safetensors import safe_open

    params = 0
    for path in llama_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    config = json.loads((llama_dir / "config.json").read_text())
    weights = roofline.weight_bytes_per_token(str(llama_dir), itemsize=2)
    # a tied model's checkpoint holds the embedding once, which a step reads as the LM head
    # (plus one embedding row); untied, the embedding table is not streamed
    extra_row = config["hidden_size"]
    if not config.get("tie_word_embeddings", False):
        params -= config["vocab_size"] * config["hidden_size"]
    assert weights["params_read"] == params + extra_row


@pytest.mark.spawns
def test_the_report(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "roofline.py"), "--model", str(llama_dir),
         "-o", "8", "--repeats", "1", "--buffer-gib", "0.25", "--out", str(out),
         "--profile", "4", "--trace", str(tmp_path / "trace.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bandwidth"]["read_gb_s"] > 0 and report["roofline_tpot_ms"] > 0
    aserve = report["aserve"]
    assert aserve["num_steps"] == 8 and aserve["tpot_ms"] > 0
    assert aserve["fraction_of_roofline"] == pytest.approx(
        report["roofline_tpot_ms"] / aserve["tpot_ms"], abs=0.002)
    assert "llamacpp" not in report
    # the profile sees the worker thread's ops (the model runs there, not on the caller's;
    # torch < 2.7 profiles the calling thread only)
    profile = aserve["profile"]
    assert profile["tokens"] == 4
    if profile["all_threads"]:
        names = [name for name, _, _ in profile["top_host_ops_ms_per_token"]]
        assert profile["host_ops_ms_per_token"] > 0 and any(n.startswith("aten::") for n in names)
    assert "device_kernels_ms_per_token" not in profile  # CPU: no device
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_a_gguf_files_bytes_per_token_are_its_stored_tensors(llama_dir, tmp_path, monkeypatch):
    """A quantized file reads its own bytes: Q8_0's 34 bytes per 32 weights, the embedding
    one row (the model is untied: its LM head is `output.weight`); and `--model` may be the
    file itself (its directory is what the bf16 roofline reads from)."""
    from helpers.gguf_models import write_gguf

    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0")
    config = json.loads((llama_dir / "config.json").read_text())
    bf16 = roofline.weight_bytes_per_token(str(llama_dir), itemsize=2)
    stored = roofline.gguf_bytes_per_token(path)
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    norms = (2 * layers + 1) * h * 4  # F32 vectors
    matrices = bf16["params_read"] - (2 * layers + 1) * h - h  # less the norms and the row
    assert stored == matrices * 34 // 32 + norms + h * 34 // 32
    assert roofline.weight_bytes_per_token(roofline.model_dir_of(str(path))) == bf16
