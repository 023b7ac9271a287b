"""Random workloads under memory pressure: the scheduler always drains, and recompute is exact.

Hypothesis draws a configuration (policy, block size, the model's attention layout: all full,
full + sliding, full + two windows, or all sliding, with windows that may be 1, below, above or
not a multiple of the block size; a cache a few blocks above what one request of
`max_model_len` holds at once, token budget, `max_num_seqs`, chunk threshold, prefix caching
and async scheduling on or off) and a workload (arrivals over time, prompts sharing prefixes so
the cache hits, max/min tokens, ignore_eos, stop tokens, priorities, salts, aborts).
`FakeRunner` checks every step: invariants (per KV cache group), budget and sequence limits,
block coverage, and the K/V each request would attend to (in a sliding group: its window only).

At the end every request has finished, every block is free, and each request streamed exactly
the tokens it streams when run alone (and that an oracle of the stop rules predicts), and its
prompt logprobs once each: the fake model samples `fake_token(req_id, position)`, so
preemption and recompute must not change a single token.
"""

from __future__ import annotations

import random

from helpers.fake_runner import hybrid_cache_config
from helpers.scheduler_scenarios import VOCAB, Scenario, Spec, check_scenario, scenarios
from hypothesis import HealthCheck, given, settings

from aserve.config import CacheConfig, PrefillPolicy, SchedulerConfig
from aserve.core.kv_cache_utils import blocks_per_request


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    check_scenario(scenario)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(kinds=("hybrid", "hybrid2")))
def test_hybrid_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    """Full attention beside one or two sliding windows: every group's hit, skip and
    preemption stays consistent with the others."""
    assert {g.kind for g in scenario.cache_config.groups} == {"full", "sliding"}
    check_scenario(scenario)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(kinds=("sliding",)))
def test_all_sliding_workloads_drain_and_match_running_alone(scenario: Scenario) -> None:
    check_scenario(scenario)


def inverted_priority_workload(rng: random.Random, trial: int, policy: str,
                               async_scheduling: bool) -> Scenario:
    """A long, least urgent prompt arrives first and is prefilled in small chunks; short, more
    urgent requests sharing its prefix arrive next and decode beside it in a nearly full cache."""
    block_size, max_model_len = rng.choice([1, 2, 4]), 24
    shared = [rng.randrange(1, VOCAB) for _ in range(20)]
    specs = [Spec(f"t{trial}-long", tuple(shared[:rng.randrange(12, 20)]), 0, 9,
                  rng.randrange(2, 5), 0, True, (), None, None)]
    for i in range(4):
        prompt = shared[:rng.randrange(0, 8)] + [rng.randrange(VOCAB)
                                                 for _ in range(rng.randrange(1, 4))]
        specs.append(Spec(f"t{trial}-{i}", tuple(prompt), rng.randrange(1, 4), rng.randrange(3),
                          rng.randrange(4, 12), 0, True, (), None, None))
    return Scenario(
        SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=16, max_model_len=max_model_len,
                        prefill=PrefillPolicy(long_prefill_token_threshold=3), policy=policy,
                        async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size,
                    num_blocks=max_model_len // block_size + 1 + rng.choice([0, 1, 2])),
        tuple(specs))


def test_seeded_inverted_priority_workloads_preempt_and_still_match() -> None:
    """Fixed workloads that preempt on every run, often a less urgent request in mid-prefill."""
    rng = random.Random(0)
    num_preemptions = 0
    for trial in range(40):
        policy = ("priority", "fcfs")[trial % 4 == 3]
        num_preemptions += check_scenario(inverted_priority_workload(
            rng, trial, policy, async_scheduling=trial % 2 == 1)).num_preemptions
    assert num_preemptions >= 40


def shared_prefix_hybrid_workload(rng: random.Random, trial: int) -> Scenario:
    """Requests sharing long prefixes arrive one after another on a hybrid (or all-sliding)
    model in a tight cache: later ones hit earlier ones' blocks in every group, some of them
    freed behind the window, while preemptions free and re-hit them."""
    block_size, max_model_len = rng.choice([1, 2, 4]), 24
    windows = rng.choice([[None, rng.randrange(1, 10)],
                          [None, rng.randrange(1, 6), None, rng.randrange(4, 12)],
                          [rng.randrange(1, 10)]])
    budget = rng.randrange(4, 17)
    shared = [rng.randrange(1, VOCAB) for _ in range(20)]
    specs = []
    for i in range(5):
        prompt = shared[:rng.randrange(6, 20)] + [rng.randrange(VOCAB)
                                                  for _ in range(rng.randrange(0, 3))]
        specs.append(Spec(f"h{trial}-{i}", tuple(prompt), 2 * i + rng.randrange(2),
                          rng.randrange(3), rng.randrange(2, 8), 0, True, (), None,
                          rng.choice([None, None, None, 12])))
    probe = hybrid_cache_config(windows, block_size=block_size, num_blocks=2)
    num_blocks = blocks_per_request(probe.groups, max_model_len, budget) + 1 + rng.randrange(3)
    return Scenario(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                        max_model_len=max_model_len, prefill=PrefillPolicy(
                            long_prefill_token_threshold=rng.choice([0, 3, 5])),
                        policy=rng.choice(["fcfs", "priority"]),
                        async_scheduling=trial % 2 == 1),
        hybrid_cache_config(windows, block_size=block_size, num_blocks=num_blocks),
        tuple(specs))


def test_seeded_shared_prefix_hybrid_workloads_hit_preempt_and_still_match() -> None:
    rng = random.Random(1)
    num_preemptions = num_hits = 0
    for trial in range(40):
        scheduler = check_scenario(shared_prefix_hybrid_workload(rng, trial))
        num_preemptions += scheduler.num_preemptions
        num_hits += scheduler.kv_cache_manager.prefix_cache_hits
    assert num_preemptions >= 20 and num_hits >= 500
