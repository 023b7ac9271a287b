"""benchmarks/sequence_parallel.py end to end with `--quick` (a tiny Llama it builds): one JSON
line with a TTFT per layout and prompt length, the ratios to one rank, the KV cache each layout
holds under one budget per rank (sp=2 and tp=2 hold one of the two kv heads, so twice the
tokens) and per-layer communication figures. Structure only: no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # the benchmark and its ranks (~40 s)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sequence_parallel  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sp")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sequence_parallel.py"), "--quick",
         "--workdir", str(tmp / "work"), "--out", str(tmp / "out.json")],
        capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    assert (tmp / "out.json").read_text().strip() == lines[0]
    return json.loads(lines[0])


def test_quick_run_reports_ttft_kv_context_and_communication(report):
    assert report["benchmark"] == "sequence_parallel" and report["prompt_lens"] == [64, 160]
    tiny = report["shapes"]["tiny"]
    assert tiny["shape"] == sequence_parallel.SHAPES["tiny"]
    assert tiny["ttft_s"].keys() == {"one", "tp2", "sp2"}
    for times in tiny["ttft_s"].values():
        assert times.keys() == {"64", "160"} and all(t > 0 for t in times.values())
    for layout in ("tp2", "sp2"):
        for n, ratio in tiny["ttft_over_one_rank"][layout].items():
            assert ratio == pytest.approx(tiny["ttft_s"][layout][n] / tiny["ttft_s"]["one"][n],
                                          abs=1e-3)
    kv = tiny["kv"]
    assert [kv[layout]["kv_heads_per_rank"] for layout in ("one", "tp2", "sp2")] == [2, 1, 1]
    assert kv["sp2"]["num_blocks"] == kv["tp2"]["num_blocks"] == 2 * kv["one"]["num_blocks"]
    assert kv["sp2"]["max_context_tokens"] == (kv["sp2"]["num_blocks"] - 1) * 16
    comm = tiny["comm_per_layer"]["64"]
    assert comm["sp2_all_to_all_ms"] > 0 and comm["tp2_all_reduce_ms"] > 0


def test_defaults_are_the_issues_sizes_and_flags_win(tmp_path):
    full = sequence_parallel.parse_args(["--workdir", str(tmp_path)])
    assert full.shapes == ["smol", "1b"] and full.prompt_lens == [2048, 4096, 8192, 16384]
    assert full.comm_lens == full.prompt_lens and full.layouts == ["one", "tp2", "sp2"]
    quick = sequence_parallel.parse_args(["--quick", "--rounds", "3", "--layouts", "one,sp2"])
    assert (quick.rounds, quick.layouts, quick.shapes) == (3, ["one", "sp2"], ["tiny"])
    with pytest.raises(SystemExit):
        sequence_parallel.parse_args(["--layouts", "sp4"])
