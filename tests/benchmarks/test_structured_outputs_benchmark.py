"""benchmarks/structured_outputs.py --quick end to end on the tiny llama it builds: one JSON line
(also written to --out) with the three served workloads, every constrained reply valid JSON of
the schema, the unconstrained replies exactly as long as their prompt's constrained one, the
ratios consistent with the figures, and the grammar timings of both schemas. Structure only: no
timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spawns]  # the benchmark and its server (~40 s)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import structured_grammar  # noqa: E402
import structured_outputs as bench  # noqa: E402

NUM_PROMPTS = bench.QUICK["num_prompts"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("structured")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "structured_outputs.py"), "--quick",
         "--workdir", str(tmp / "work"), "--large-properties", "30", "--cold-variants", "2",
         "--out", str(tmp / "out.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    assert (tmp / "out.json").read_text().strip() == lines[0]
    return json.loads(lines[0])


def test_every_workload_completes_and_every_constrained_reply_validates(report):
    assert report["benchmark"] == "structured_outputs"
    serve = report["serve"]
    workloads = serve["workloads"]
    assert set(workloads) == set(bench.WORKLOADS)
    expected_constrained = {"constrained": NUM_PROMPTS, "unconstrained": 0,
                            "mix": NUM_PROMPTS // 2}
    for name, w in workloads.items():
        assert (w["completed"], w["failed"]) == (NUM_PROMPTS, 0), name
        assert w["num_constrained"] == expected_constrained[name]
        assert w["validation"]["num_valid"] == w["validation"]["num_checked"] == \
            w["num_constrained"], w["validation"]["errors"]
        assert w["validation"]["finish_reasons"].get("stop", 0) == w["num_constrained"]
        assert w["output_tokens"] == w["output_tokens_constrained"] + \
            w["output_tokens_unconstrained"]
        assert 0 < w["ttft_ms"]["p50"] <= w["e2e_ms"]["p50"]
        assert len(w["rounds_output_tokens_per_s"]) == 1  # --quick: one round
    calibration = serve["calibration"]["validation"]
    assert calibration["num_valid"] == calibration["num_checked"] == NUM_PROMPTS


def test_unconstrained_replies_are_as_long_as_the_calibrated_constrained_ones(report):
    serve = report["serve"]
    lengths = serve["output_lengths"]
    assert lengths["total"] == serve["calibration"]["output_tokens"]
    assert 0 < lengths["min"] <= lengths["max"] < serve["max_tokens"]  # every JSON ended
    unconstrained = serve["workloads"]["unconstrained"]
    assert unconstrained["num_unconstrained_at_length"] == NUM_PROMPTS  # ignore_eos
    assert unconstrained["output_tokens"] == lengths["total"]
    assert serve["workloads"]["mix"]["num_unconstrained_at_length"] == NUM_PROMPTS // 2
    assert "tpot_ms_by_kind" in serve["workloads"]["mix"]


def test_ratios_are_the_workloads_figures_over_unconstrained(report):
    serve = report["serve"]
    base = serve["workloads"]["unconstrained"]
    for name in ("constrained", "mix"):
        ratios, w = serve["ratios"][f"{name}_over_unconstrained"], serve["workloads"][name]
        assert ratios["output_tokens_per_s"] == pytest.approx(
            w["output_tokens_per_s"] / base["output_tokens_per_s"], abs=1e-3)
        assert ratios["tpot_p50"] == pytest.approx(
            w["tpot_ms"]["p50"] / base["tpot_ms"]["p50"], abs=1e-3)
    assert serve["goal_met"] == (serve["ratios"]["constrained_over_unconstrained"]
                                 ["output_tokens_per_s"] >= 0.9)


def test_grammar_timings_cover_both_schemas(report):
    grammar = report["grammar"]
    assert grammar["vocab_size"] == 512
    assert grammar["tokenizer_setup_ms"] > 0 and grammar["first_fill_bitmask_ms"] > 0
    assert grammar["schema"]["num_properties"] == len(structured_grammar.SCHEMA["properties"])
    unbounded = grammar["schema_unbounded_strings"]  # the same instance, the same tokens
    assert unbounded["instance_tokens"] == grammar["schema"]["instance_tokens"]
    large = grammar["large_schema"]
    assert large["num_properties"] == 30
    for timings in (grammar["schema"], unbounded, large):
        assert timings["instance_tokens"] > 0 and timings["matcher_init_ms"] > 0
        assert set(timings["fill_bitmask_us"]) == {"mean", "p50", "p99"}
    assert large["cold_compile_ms"]["p50"] > 0 and large["cached_compile_us"] > 0
    for key in ("apply_token_bitmask_ms", "apply_token_bitmask_ref_ms",
                "apply_token_bitmask_over_ref"):
        assert set(grammar[key]) == {"4_of_4_rows", "2_of_4_rows"}, key


def test_the_large_schema_is_large_and_its_instances_validate():
    import random

    import jsonschema

    schema = structured_grammar.large_schema(120)
    assert len(schema["properties"]) == 120
    assert json.dumps(schema).count('"type": "object"') > 60  # objects nested in it
    rng = random.Random(0)
    for s in (schema, structured_grammar.SCHEMA):
        jsonschema.validate(structured_grammar.instance_of(s, rng), s)
