"""benchmarks/revisions.py without a model: its arguments, the launcher that makes a child import
the given tree's aserve (not the editable install's), and the best-round aggregation on canned
round results. No timing thresholds, no real runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import revisions  # noqa: E402


@pytest.mark.spawns
def test_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "revisions.py"), "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--before" in out and "--rounds" in out


def test_arguments(tmp_path):
    args = revisions.parse_args(["--model", str(tmp_path), "--before", str(ROOT),
                                 "--workdir", str(tmp_path / "w")])
    assert args.offline and args.serve  # neither flag: both
    assert args.trees == {"before": ROOT, "after": ROOT}
    assert args.concurrency == [8, 32] and args.rounds == 2
    assert (args.num_prompts, args.input_len, args.output_len) == (64, 128, 128)
    with pytest.raises(SystemExit):
        revisions.parse_args(["--model", str(tmp_path), "--before", str(tmp_path)])  # no aserve/
    # round 0: before first, round 1: after first
    assert [revisions.rotated(list(revisions.TREES), r) for r in range(3)] == [
        ["before", "after"], ["after", "before"], ["before", "after"]]


@pytest.mark.spawns
def test_launcher_imports_the_given_tree(tmp_path):
    """Run from this repo (where '' and the editable install both point), the child still
    imports the other tree's aserve."""
    (tmp_path / "aserve").mkdir()
    (tmp_path / "aserve" / "__init__.py").write_text("")
    info = revisions.describe_tree(tmp_path.resolve())
    assert info["aserve_file"] == str((tmp_path / "aserve" / "__init__.py").resolve())
    assert "git_commit" not in info  # not a checkout of its own


def test_aggregation_takes_the_best_round():
    offline = revisions.aggregate_offline({
        "before": [{"output_tokens_per_s": 100.0}, {"output_tokens_per_s": 120.0}],
        "after": [{"output_tokens_per_s": 90.0}, {"output_tokens_per_s": 132.0}]})
    assert offline["before"]["output_tokens_per_s"] == 120.0
    assert offline["after"]["output_tokens_per_s"] == 132.0
    assert offline["after_over_before"] == 1.1

    def run(tok_s: float, ttft: float, ready: float) -> dict:
        figures = {"num_prompts": 32, "completed": 32, "failed": 0,
                   "output_tokens_per_s": tok_s, "ttft_ms": {"p50": ttft},
                   "tpot_ms": {"p50": 10.0}}
        return {"readiness_s": ready, "loadavg_1m": 0.1, "aserve_file": "x",
                "by_concurrency": {"8": figures}}

    serve = revisions.aggregate_serve(
        {"before": [run(200.0, 100.0, 3.0), run(250.0, 80.0, 2.5)],
         "after": [run(275.0, 40.0, 2.0), run(260.0, 30.0, 4.0)]}, [8])
    assert serve["trees"]["before"]["8"]["output_tokens_per_s"] == 250.0
    assert serve["trees"]["after"]["8"]["ttft_ms"]["p50"] == 40.0  # the best round, whole
    assert serve["trees"]["after"]["8"]["rounds_output_tokens_per_s"] == [275.0, 260.0]
    assert serve["readiness_s"]["before"] == {"best": 2.5, "rounds": [3.0, 2.5]}
    assert serve["readiness_s"]["after_over_before"] == 0.8
    assert serve["after_over_before"]["8"] == {"output_tokens_per_s": 1.1, "ttft_p50": 0.5,
                                               "tpot_p50": 1.0}
