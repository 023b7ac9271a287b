"""benchmarks/itl.py: how it joins streamed token gaps to the server's steps (on synthetic
timelines), and `--quick` end to end on the tiny llama it builds (serve.py's client, one round):
one JSON line of the figures, the step kinds and the tail report. Structure only: no timing
thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import itl  # noqa: E402


def test_each_gap_is_joined_to_the_step_that_ended_last_before_its_token():
    steps = [(1.0, 512, 0, 0.9), (1.1, 0, 2, 0.08), (1.5, 256, 2, 0.35), (1.6, 0, 3, 0.09)]
    # tokens at 1.01, 1.12, 1.52, 1.62: after steps 0, 1, 2, 3
    requests = [(0.0, 1.01, [0.11, 0.40, 0.10])]
    gaps = itl.attribute_gaps(requests, steps)
    assert [(g["prefill"], g["decode"], g["step_s"], g["steps_in_gap"]) for g in gaps] == [
        (0, 2, 0.08, 1), (256, 2, 0.35, 1), (0, 3, 0.09, 1)]
    assert [round(g["gap_s"], 6) for g in gaps] == [0.11, 0.4, 0.1]
    # a request that missed a step: its gap spans two step ends
    late = itl.attribute_gaps([(0.0, 1.01, [0.51])], steps)
    assert [(g["prefill"], g["steps_in_gap"]) for g in late] == [(256, 2)]


def test_the_tail_report_says_what_the_p99_gaps_were_made_of():
    gaps = [{"gap_s": 0.05, "prefill": 0, "decode": 32, "step_s": 0.045, "steps_in_gap": 1}
            for _ in range(198)]
    gaps += [{"gap_s": 0.30, "prefill": 512, "decode": 28, "step_s": 0.28, "steps_in_gap": 1}
             for _ in range(2)]
    tail = itl.tail_report(gaps)
    assert tail["num_gaps"] == 200 and tail["num_tail_gaps"] == 2
    assert tail["tail_share_after_a_prefill_step"] == 1.0
    assert tail["tail_prefill_tokens_p50"] == 512
    assert tail["tail_step_ms_p50"] == 280.0
    assert tail["tail_gap_minus_step_ms_p50"] == 20.0
    assert tail["share_of_all_gaps_after_a_prefill_step"] == 0.01
    assert "512" in tail["says"]


def test_steps_are_summarised_by_kind():
    steps = [(0.0, 512, 0, 0.3), (0.1, 0, 4, 0.05), (0.2, 128, 4, 0.1), (0.3, 0, 4, 0.05)]
    summary = itl.step_summary(steps)
    assert {k: v["num_steps"] for k, v in summary.items()} == {
        "decode_only": 2, "mixed": 1, "prefill_only": 1}
    assert summary["mixed"]["prefill_tokens_p50"] == 128
    assert summary["decode_only"]["seconds_p50_ms"] == 50.0


@pytest.mark.slow
@pytest.mark.spawns  # the benchmark and its server
def test_quick_run_reports_figures_steps_and_the_tail(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "itl.py"), "--quick",
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and (tmp_path / "out.json").read_text().strip() == lines[0]
    report = json.loads(lines[0])
    assert report["benchmark"] == "itl"
    chat = report["engines"]["after"]["chat"]
    assert set(itl.FIGURES) <= set(chat)
    (run,) = chat["rounds"]
    spec = itl.QUICK_CHAT
    assert run["completed"] == spec["num_prompts"]
    assert set(run["steps"]) == {"decode_only", "mixed", "prefill_only"}
    num_steps = sum(kind["num_steps"] for kind in run["steps"].values())
    assert num_steps >= spec["output_len"]  # at least one step per token of a request
    tail = run["tail"]
    assert tail["num_gaps"] == spec["num_prompts"] * (spec["output_len"] - 1)
    assert 1 <= tail["num_tail_gaps"] <= tail["num_gaps"]
    timeline = json.loads(Path(run["timeline"]).read_text())
    assert len(timeline["steps"]) == num_steps
    assert len(timeline["requests"]) == spec["num_prompts"]
