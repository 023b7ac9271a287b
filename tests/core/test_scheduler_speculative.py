"""Speculative decoding's scheduler side under random workloads (the property test's, with
n-gram drafts on): drafts ride along decodes, get KV slots, and roll back when rejected, and
every request still streams exactly the tokens its stop rules give, under memory pressure,
chunking, prefix hits, sliding windows and aborts. The fake model repeats itself with noise, so
drafts are accepted and rejected both; `FakeRunner` verifies them as greedy does and checks
every step's slots, tables and prefix-cache contents."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.scheduler_scenarios import (
    VOCAB,
    Scenario,
    Spec,
    check_scenario,
    repeating,
    scenarios,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from aserve.core.scheduler import Scheduler


@st.composite
def speculative_scenarios(draw: st.DrawFn) -> Scenario:
    scenario = draw(scenarios())
    method = draw(st.sampled_from(["ngram", "suffix", "draft_model"]))
    if method == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=draw(st.integers(1, 4)),
                                 prompt_lookup_min=1, prompt_lookup_max=draw(st.integers(1, 3)))
    elif method == "draft_model":  # (FakeRunner drafts as a draft model would)
        spec = SpeculativeConfig(method="draft_model", model="fake",
                                 num_speculative_tokens=draw(st.integers(1, 4)))
    else:
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=draw(st.integers(1, 6)),
                                 suffix_decoding_max_tree_depth=draw(st.integers(2, 8)),
                                 suffix_decoding_max_spec_factor=draw(st.sampled_from([0.5, 1.0,
                                                                                       3.0])),
                                 suffix_decoding_min_token_prob=draw(st.sampled_from([0.0, 0.3])))
    config = dataclasses.replace(scenario.scheduler_config, speculative=spec)
    return dataclasses.replace(scenario, scheduler_config=config, token_fn=repeating)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(speculative_scenarios())
def test_random_workloads_with_drafts_stream_what_the_model_samples(scenario: Scenario) -> None:
    check_scenario(scenario)


def test_drafts_are_accepted_and_rejected_and_counted() -> None:
    """Fixed workloads: drafts are verified, some accepted, some rejected, and the counters
    add up (accepted by position sum to the accepted total)."""
    rng = random.Random(0)
    draft_tokens = accepted = preemptions = 0
    for trial in range(12):
        specs = tuple(Spec(f"t{trial}-{i}", tuple(rng.randrange(1, VOCAB) for _ in range(
            rng.randrange(1, 8))), rng.randrange(3), 0, rng.randrange(6, 20), 0, True, (),
            None, None) for i in range(4))
        config = SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=rng.choice([4, 8, 32]), max_model_len=28,
            speculative=SpeculativeConfig(num_speculative_tokens=rng.randrange(1, 5),
                                          prompt_lookup_min=1, prompt_lookup_max=2))
        cache = CacheConfig(block_size=rng.choice([1, 2, 4]), num_blocks=rng.choice([30, 60]))
        scheduler: Scheduler = check_scenario(Scenario(config, cache, specs, repeating))
        stats = scheduler.make_stats()
        assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
            stats.spec_decode_num_accepted_tokens)
        draft_tokens += stats.spec_decode_num_draft_tokens
        accepted += stats.spec_decode_num_accepted_tokens
        preemptions += stats.num_preemptions
    assert 0 < accepted < draft_tokens
    assert preemptions > 0


@pytest.mark.parametrize("pays", [True, False], ids=["drafts_pay", "drafts_do_not_pay"])
def test_async_scheduling_overlaps_the_requests_that_do_not_draft(monkeypatch, pays) -> None:
    """Under async scheduling a request whose drafts pay waits for its token in flight (its
    drafts follow that token) and speculates; where they do not pay (a compute-bound batch) it
    is scheduled again with its token in flight, as without speculation. Either way it streams
    what the model samples (`check_scenario`)."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts",
                        lambda k, *_: k if pays else 0)
    overlapped: list[str] = []
    original = Scheduler.schedule

    def schedule(self: Scheduler):
        in_flight = {r.request_id for r in self.running if r.num_output_placeholders}
        output = original(self)
        overlapped.extend(set(output.num_scheduled_tokens) & in_flight)
        return output

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    rng = random.Random(1)
    specs = tuple(Spec(f"r{i}", tuple(rng.randrange(1, VOCAB) for _ in range(
        rng.randrange(2, 8))), 0, 0, 16, 0, True, (), None, None) for i in range(3))
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40, async_scheduling=True,
        speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                      prompt_lookup_max=2))
    scheduler = check_scenario(Scenario(config, CacheConfig(block_size=4, num_blocks=64),
                                        specs, repeating))
    drafted = scheduler.make_stats().spec_decode_num_draft_tokens
    if pays:
        assert drafted > 0 and not overlapped
    else:
        assert drafted == 0 and overlapped
