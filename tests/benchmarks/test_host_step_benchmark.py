"""benchmarks/studies/host_step.py on the tiny llama: the stubbed engine still runs every phase,
the opcode count names the engine's and the worker's threads, and `--against` alternates two
engine processes. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "studies" / "host_step.py"
PHASES = ("step", "schedule", "update", "outputs", "runner_inputs", "forward", "runner_sample")


def run(args: list[str]) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.spawns
def test_the_phases_and_the_opcode_count(llama_dir, tmp_path):
    out = tmp_path / "o.json"
    report = run(["--model", str(llama_dir), "--rounds", "1", "-n", "4", "-i", "8", "-o", "6",
                  "--opcodes", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    medians = report["ms_per_step_median"]
    assert all(medians[phase] > 0 for phase in PHASES)
    assert medians["steps"] >= 6  # the stub still ran the whole schedule
    opcodes = report["opcodes_per_step"]
    assert opcodes["per_thread"]["MainThread"] > 0
    assert any(name.startswith("aserve-worker") for name in opcodes["per_thread"])
    assert any(name.startswith("scheduler.py:") for name in opcodes["top_functions"])


@pytest.mark.spawns
def test_against_a_tree_alternates_two_engines(llama_dir):
    report = run(["--model", str(llama_dir), "--rounds", "2", "-n", "4", "-i", "8", "-o", "6",
                  "--against", str(ROOT)])
    assert len(report["step_ms_rounds"]["this"]) == len(report["step_ms_rounds"]["against"]) == 2
    assert set(report["this_over_against"]) == set(PHASES) | {"other"}
    assert report["this"]["steps"] == report["against"]["steps"]
