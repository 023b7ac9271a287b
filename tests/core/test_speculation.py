"""The scheduler side of speculative decoding, torch-free: the n-gram proposer, which requests
may speculate, and the policy that stops drafting once a step is compute-bound."""

from __future__ import annotations

import pytest
from helpers.fake_runner import FakeRunner, fake_token
from helpers.scheduler_scenarios import repeating

from aserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.core.speculation import (
    NgramProposer,
    SuffixProposer,
    can_speculate,
    max_drafts_before_min_tokens,
    worthwhile_drafts,
)
from aserve.sampling_params import SamplingParams


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=3))
    assert proposer.propose("r", [1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    assert proposer.propose("r", [1, 2, 3, 4, 5, 9, 1, 2, 3], max_drafts=1) == [4]
    # the longest suffix wins over a later shorter match: "2 3" occurs last before "7 2 3"
    assert proposer.propose("r", [7, 2, 3, 8, 8, 2, 3, 5, 7, 2, 3]) == [8, 8, 2]
    assert proposer.propose("r", [4, 5, 6]) == []  # nothing repeats
    assert proposer.propose("r", [6, 1, 6, 2, 6, 3, 6]) == [3, 6]  # the latest match, to the end
    strict = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert strict.propose("r", [1, 2, 9, 2]) == []  # one token matches, two do not


def half_repeating(req_id: str, position: int) -> int:
    """`repeating` at odd positions, anything at even ones: drafts half accepted."""
    return repeating(req_id, position) if position % 2 else fake_token(req_id, position, 12)


def suffix(**keys) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig.from_value({"method": "suffix", **keys}))


def test_suffix_drafts_follow_the_longest_match_as_far_as_it_is_long() -> None:
    proposer = suffix()
    assert proposer.k == 24  # num_speculative_tokens: max_tree_depth by default
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert proposer.propose("a", tokens) == [4, 5, 6]  # a match of 3: 3 drafts (factor 1)
    tokens += [4, 5, 6, 7]  # the request's own list grows; the index follows it
    assert proposer.propose("a", tokens) == [8, 9, 1, 2, 3, 4, 5]  # a match of 7
    assert proposer.propose("a", tokens, max_drafts=2) == [8, 9]
    assert suffix(suffix_decoding_max_spec_factor=0.5).propose("b", tokens) == [8, 9, 1]
    assert proposer.propose("c", [4, 5, 6]) == []  # its own tokens only (nothing cached yet)


def test_suffix_drafts_take_the_most_frequent_continuation_while_likely() -> None:
    # "5 7" (each time after another token than 9's) was followed by 1 twice and by 2 once:
    # 1 (2/3); then "5 7 1" by 3 both times; a match of 2 allows 2 drafts
    tokens = [5, 7, 1, 3, 0, 5, 7, 1, 3, 0, 5, 7, 2, 4, 9, 5, 7]
    assert suffix().propose("a", tokens) == [1, 3]
    # a path of probability 2/3 is below 0.7: nothing
    assert suffix(suffix_decoding_min_token_prob=0.7).propose("a", tokens) == []


def test_suffix_drafts_come_from_recent_requests_outputs() -> None:
    proposer = suffix(suffix_decoding_max_cached_requests=2)
    proposer.finish("old", [10, 11, 12, 13, 14, 15])
    assert proposer.propose("new", [99, 10, 11, 12]) == [13, 14, 15]
    proposer.finish("x", [20, 21, 22, 23])
    proposer.finish("y", [30, 31, 32, 33])  # the oldest leaves the cache (2 at most)
    assert proposer.propose("new2", [99, 10, 11, 12]) == []
    assert proposer.propose("new3", [7, 30, 31]) == [32, 33]
    assert suffix(suffix_decoding_max_cached_requests=0).propose("z", [10, 11]) == []


def test_which_requests_speculate() -> None:
    for params in [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=3),
                   SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
                   SamplingParams(logit_bias={3: 1.0}), SamplingParams(min_tokens=9),
                   SamplingParams(logprobs=2), SamplingParams(repetition_penalty=1.2),
                   SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3)]:
        assert can_speculate(params), params
    assert not can_speculate(SamplingParams(temperature=1.0, seed=3))
    # below min_tokens, drafts end before it: outputs 3 of min 8 -> positions 3 (the step's
    # token), 4..7 drafts at most; at 7 none; from 8 on no limit
    assert max_drafts_before_min_tokens(3, 8) == 4
    assert max_drafts_before_min_tokens(7, 8) == 0
    assert max_drafts_before_min_tokens(8, 8) is None


def test_worthwhile_drafts_fall_as_the_batch_grows() -> None:
    assert worthwhile_drafts(4, 0.7, None, 500) == 4  # no fit yet: all
    counts = [worthwhile_drafts(4, 0.7, 200.0, d) for d in (1, 10, 100, 300, 1000, 5000)]
    assert counts == sorted(counts, reverse=True) and counts[0] == 4 and counts[-1] == 0
    # draft j pays while 0.7^j (F + D) > D: D = 300, F = 200 -> 0.7 > 0.6 > 0.49
    assert worthwhile_drafts(4, 0.7, 200.0, 300) == 1
    assert worthwhile_drafts(4, 0.0, 200.0, 1) == 2  # a floor: 0.1^2 * 201 > 1 > 0.1^3 * 201
    assert worthwhile_drafts(4, 0.95, 200.0, 300) > worthwhile_drafts(4, 0.5, 200.0, 300)
    # a draft model's pass costs its time (in tokens of the fit): a cheap one still pays, one
    # as costly as the step never does
    assert worthwhile_drafts(3, 0.99, 200.0, 1, pass_tokens=50.0) == 3
    assert worthwhile_drafts(3, 0.99, 200.0, 1, pass_tokens=300.0) == 0
    assert (worthwhile_drafts(3, 0.8, 200.0, 32, pass_tokens=120.0)
            < worthwhile_drafts(3, 0.8, 200.0, 32))


@pytest.mark.parametrize("num_requests, drafts_late", [(1, True), (40, False)])
def test_drafting_stops_when_steps_are_compute_bound(num_requests: int,
                                                     drafts_late: bool) -> None:
    """Steps cost 10 ms + 1 ms a token (F = 10 tokens), drafts are accepted about half the
    time: one stream keeps drafting, forty streams stop once the fit and their acceptance
    are known (a draft pays while acceptance^j (F + D) > D: 0.5 < 40 / 50), but for a rare
    probe (`ACCEPTANCE_RELAX`: an estimate drifts back toward 1 while nothing is verified)."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=200,
                             speculative=SpeculativeConfig(num_speculative_tokens=3,
                                                           prompt_lookup_min=1))
    scheduler = Scheduler(config, CacheConfig(block_size=4, num_blocks=4000))
    runner = FakeRunner(scheduler, half_repeating,
                        step_seconds=lambda prefill, decode: 0.010 + 0.001 * (prefill + decode))
    for i in range(num_requests):
        scheduler.add_request(Request(f"r{i}", [1 + i % 7, 2, 3], SamplingParams(
            temperature=0.0, max_tokens=60, ignore_eos=True)))
    late_drafts = late_decodes = 0
    for step in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = runner.step()
        if step >= 20:
            late_drafts += sum(map(len, output.scheduled_spec_decode_tokens.values()))
            late_decodes += len(output.num_scheduled_tokens)
    assert not scheduler.has_unfinished_requests()
    if drafts_late:
        assert late_drafts > 0
    else:  # a probe now and then: an estimate drifts back toward 1 while unmeasured
        assert late_drafts < 0.01 * late_decodes
    assert all(len(tokens) == 60 for tokens in runner.streamed.values())


def test_suffix_memory_is_bounded_whatever_the_lengths() -> None:
    proposer = suffix()
    proposer.WINDOW = window = 64  # (4096 by default)
    tokens = [i % 500 for i in range(3 * window)]  # a hostile prompt: far past the window
    proposer.propose("long", tokens)
    generated = window + 10
    for i in range(generated):  # and a long generation after it
        tokens.append(i % 7)
        proposer.propose("long", tokens)
    _, _, index = proposer._own["long"]
    assert sum(map(len, index.values())) <= 2 * window
    # drafts still come from the window: the generation repeats with period 7
    assert proposer.propose("long", tokens)[:7] == [(generated + j) % 7 for j in range(7)]
    proposer.finish("long", tokens)
    assert "long" not in proposer._own
    assert proposer._cache_tokens <= SuffixProposer.MAX_CACHED_TOKENS


def test_proposing_stops_at_the_steps_time_budget(monkeypatch) -> None:
    """Past PROPOSE_SECONDS of lookups in a step, requests decode a token (their tokens are
    the same either way): an engine thread's step time has a bound whatever texts make the
    lookups cost."""
    import aserve.core.spec_policy as spec_policy_module

    def run(budget: float) -> tuple[dict[str, list[int]], int]:
        monkeypatch.setattr(spec_policy_module, "PROPOSE_SECONDS", budget)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                 max_model_len=100,
                                 speculative=SpeculativeConfig(prompt_lookup_min=1))
        scheduler = Scheduler(config, CacheConfig(block_size=4, num_blocks=400))
        runner = FakeRunner(scheduler, repeating)
        for i in range(4):
            scheduler.add_request(Request(f"r{i}", [1 + i, 2, 3], SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True)))
        runner.run_until_done()
        return runner.streamed, scheduler.make_stats().spec_decode_num_draft_tokens

    with_drafts, drafted = run(1.0)
    without, none = run(0.0)
    assert drafted > 0 and none == 0 and without == with_drafts


def test_a_new_request_starts_from_every_requests_rate_once_there_is_one() -> None:
    """Before any verification a request is taken to accept all of its drafts; once 64
    drafts were verified, it starts from their rate: a drafter whose drafts are rarely
    accepted keeps new requests from drafting (and, under async scheduling, from waiting to
    draft), a good one does not."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                             speculative=SpeculativeConfig(num_speculative_tokens=3,
                                                           prompt_lookup_min=1))
    scheduler = Scheduler(config, CacheConfig(block_size=4, num_blocks=64))
    for n in range(1, 40):  # a step costs 4 ms + 0.5 ms a token: F = 8
        scheduler.step_cost.record(n, 0.004 + 0.0005 * n)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
                for i in range(4)]
    scheduler.running = list(requests)  # four decoding: a draft pays while α (8 + 4) > 4
    spec, running = scheduler.spec, scheduler.running
    assert spec.drafts_for(requests[0], 4) > 0  # nothing verified yet: α = 1
    spec.num_draft_tokens, spec.accepted_per_pos = 100, [4, 0, 0]
    assert spec.drafts_for(requests[0], 4) == 0 and not spec.drafting_pays(running)
    spec.accepted_per_pos = [50, 20, 10]
    assert spec.drafts_for(requests[0], 4) > 0 and spec.drafting_pays(running)
    requests[0].spec_acceptance = 0.05  # its own rate, once it has one, decides
    assert spec.drafts_for(requests[0], 4) == 0
