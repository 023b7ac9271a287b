"""benchmarks/prefill.py on the tiny llama, aserve only (the peers need their own installs):
one JSON line with seconds and tokens/s per prompt length, each length's prompt really
prefilled. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import prefill  # noqa: E402


def test_each_length_is_timed_on_a_prompt_of_that_length():
    seen = []

    def generate(prompt):
        seen.append(prompt)
        time.sleep(0.01)

    report = prefill.time_lengths(generate, [5, 9], repeats=2, vocab=100)
    assert [len(p) for p in seen] == [16, 5, 5, 9, 9]  # the warm-up, then each length twice
    assert seen[1] != seen[2]  # a fresh prompt per repeat: no prefix cache can serve it
    assert set(report) == {"5", "9"}
    for n, figures in report.items():
        assert figures["tokens_per_s"] == pytest.approx(int(n) / figures["seconds"], rel=0.01)


def test_llamacpp_needs_its_model():
    with pytest.raises(SystemExit):
        prefill.parse_args(["--model", ".", "--engines", "aserve,llamacpp"])


@pytest.mark.spawns
def test_the_report(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prefill.py"), "--model", str(llama_dir),
         "--engines", "aserve", "--lengths", "24,40", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert out.read_text().strip() == line
    report = json.loads(line)
    assert report["benchmark"] == "prefill" and report["lengths"] == [24, 40]
    assert set(report["engines"]["aserve"]) == {"24", "40"}
    assert report["aserve_over"] == {}
