"""benchmarks/schedule_sim.py: the simulator drives the real scheduler to the end of a small
closed-loop workload, every request streams exactly its output tokens, the virtual clock is the
cost model's sum, the copied default policy is faithful, and a smaller prefill cap never makes
the longest step that carries decodes longer."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import schedule_sim as sim  # noqa: E402

TINY = {"input_len": 96, "output_len": 12, "concurrency": 6, "num_prompts": 18}
EXACT = sim.StepCost(noise=0.0)


def test_every_request_streams_exactly_its_output_tokens() -> None:
    run, first = sim.run_closed_loop(TINY, "default", sim.StepCost(), seed=3)
    assert sorted(run.sent) == sorted(f"r{i}" for i in range(TINY["num_prompts"]))
    for req_id in run.sent:
        times = run.token_times[req_id]
        assert len(times) == TINY["output_len"], req_id
        assert times == sorted(times) and times[0] > run.sent[req_id]
    assert not run.scheduler.has_unfinished_requests() and not run.inbox
    assert first == 2  # the warm-up: a prefill step and one decode


def test_the_clock_advances_by_the_cost_model() -> None:
    cost = replace(EXACT, a_pre=0.002)
    run, _ = sim.run_closed_loop({**TINY, "concurrency": 1, "num_prompts": 1}, "default", cost,
                                 warmup=False)
    # One 96-token prompt, alone: a prefill step, then 11 decodes at positions 96..106.
    prefill = (cost.a + cost.a_pre + cost.b_pre * 96 + cost.c_attn * 96 * 97 / 2)
    decodes = [cost.a + cost.b_dec + cost.c_dec_attn * (p + 1) for p in range(96, 107)]
    assert [s.seconds for s in run.steps] == pytest.approx([prefill, *decodes])
    assert run.clock == pytest.approx(prefill + sum(decodes) + 12 * cost.overhead)
    assert run.token_times["r0"][0] == pytest.approx(prefill + cost.overhead)  # TTFT
    assert cost.seconds([(0, 96, False), (96, 1, True)]) == pytest.approx(
        prefill + decodes[0] - cost.a)


def test_noise_is_seeded_and_multiplicative() -> None:
    a, _ = sim.run_closed_loop(TINY, "default", sim.StepCost(noise=0.1), seed=1)
    b, _ = sim.run_closed_loop(TINY, "default", sim.StepCost(noise=0.1), seed=1)
    exact, _ = sim.run_closed_loop(TINY, "default", EXACT, seed=1)
    assert [s.seconds for s in a.steps] == [s.seconds for s in b.steps]
    ratios = [math.log(s.seconds / e.seconds) for s, e in zip(a.steps[:2], exact.steps[:2])]
    assert all(abs(r) < 0.5 for r in ratios) and any(r != 0 for r in ratios)


def test_the_copied_policies_give_the_scheduler_s_own_runs() -> None:
    for workload in ("chat", "long", "prefix"):
        assert ({**sim.simulate(workload, "copy"), "policy": "default:k=0"}
                == sim.simulate(workload, "default:k=0"))
        assert ({**sim.simulate(workload, "streams"), "policy": "default"}
                == sim.simulate(workload, "default"))


def test_a_smaller_cap_gives_no_longer_steps_beside_decodes() -> None:
    def longest(policy: str) -> tuple[float, int]:
        run, first = sim.run_closed_loop(TINY, policy, EXACT)
        mixed = [s for s in run.steps[first:] if s.num_decode]
        return max(s.seconds for s in mixed), max(s.num_prefill for s in mixed)

    default_s, default_tokens = longest("default")
    small_s, small_tokens = longest("fixed:c=16,few=0")
    assert small_tokens <= 16 < default_tokens
    assert small_s < default_s


def test_least_squares_recovers_a_step_cost() -> None:
    xs = [[1.0, d, p] for d in (1, 8, 32) for p in (0, 64, 256)]
    ys = [0.009 + 0.00045 * x[1] + 0.00026 * x[2] for x in xs]
    assert sim.least_squares(xs, ys) == pytest.approx([0.009, 0.00045, 0.00026])
