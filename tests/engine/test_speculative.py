"""Speculative decoding end to end (n-gram drafts): greedy outputs identical with and without
it under the schedules that move `num_computed_tokens` (chunks, preemption, prefix hits), stop
tokens and max_tokens inside accepted drafts, random sampling's lengths, and bad configs."""

from __future__ import annotations

import random

import pytest

from aserve import LLM, SamplingParams
from aserve.config import SpeculativeConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}


@pytest.fixture(autouse=True)
def every_draft_proposed(monkeypatch):
    """The cost policy drafts by the step times it measures, so how many drafts a run
    verifies would depend on the host's moment: lifted here, where the tests count them
    (tests/core/test_speculation.py tests the policy)."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)


def prompts(count: int = 6) -> list[dict]:
    """Prompts that repeat themselves (as edits and quotes do): a random run, twice over,
    with a little in between, so drafts come from the prompt as well as from the output."""
    rng = random.Random(0)
    out = []
    for i in range(count):
        run = [rng.randrange(3, 500) for _ in range(8 + 3 * i)]
        out.append({"prompt_token_ids": run + [rng.randrange(3, 500)] + run[: 4 + i]})
    return out


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    llm = LLM(llama_dir, dtype="float32", max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy())]


@pytest.mark.parametrize("settings", [
    {},
    {"async_scheduling": False},
    {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16},
    {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 80},
], ids=["default", "synchronous", "16_token_chunks", "forced_preemption"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_is_the_same_with_drafts(llama_dir, reference, settings, method) -> None:
    llm = LLM(llama_dir, dtype="float32", speculative_config=METHODS[method],
              **{"max_model_len": 256, **settings})
    rounds = []
    for _ in range(2):  # the second round hits the prefix cache (and suffix's own cache)
        outs = llm.generate(prompts(), greedy())
        assert [o.outputs[0].token_ids for o in outs] == reference
        rounds.append(llm.stats())
    stats = rounds[-1]
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens)
    if method == "ngram":  # drafts were rejected too (steps rolled back)
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    else:  # the second round's replies are the first's: drafted from the cache, whole
        first, second = (r.spec_decode_num_accepted_tokens for r in rounds)
        assert second - first >= first
    if "num_kv_blocks" in settings:
        assert stats.num_preemptions > 0
    else:
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("method", list(METHODS))
def test_stops_and_max_tokens_inside_accepted_drafts(llama_dir, reference, method) -> None:
    llm = LLM(llama_dir, dtype="float32", max_model_len=256,
              speculative_config=METHODS[method])
    for want, tokens in zip(prompts(), reference):
        stop = tokens[25]
        first = tokens.index(stop)
        out = llm.generate([want], greedy(stop_token_ids=[stop]))[0].outputs[0]
        assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop"
        for max_tokens in (1, 7, 23):
            out = llm.generate([want], greedy(max_tokens))[0].outputs[0]
            assert out.token_ids == tokens[:max_tokens] and out.finish_reason == "length"
    assert llm.stats().spec_decode_num_accepted_tokens > 0


def test_random_sampling_with_drafts_keeps_its_lengths(llama_dir) -> None:
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.3, top_k=5, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts(), params)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert llm.stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("config", [
    {"method": "eagle"}, {"method": "mtp"}, {"num_speculative_tokens": 0},
    {"prompt_lookup_min": 0},
    {"num_speculative_tokens": 99}, {"bogus": 1}, "{not json",
    {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
    {"method": "suffix", "suffix_decoding_max_tree_depth": "8"},
])
def test_bad_speculative_configs_are_refused(llama_dir, config) -> None:
    with pytest.raises(SpeculativeConfigError):
        LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=config)


def test_stop_strings_end_where_a_token_a_step_ends_them(llama_dir) -> None:
    """A stop string completed by an accepted draft in the middle of a step's tokens: the
    output ends at that token (later accepted tokens are dropped), text and ids as without
    drafts. The stops are prefixes of the reply's text (from its second character), so each
    first appears where it ends, one token after another."""
    want = {"prompt_token_ids": [100, 200, 300] * 4}  # its reply repeats: drafts accepted
    base = LLM(llama_dir, dtype="float32", max_model_len=256)
    spec = LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    text = base.generate([want], greedy(60))[0].outputs[0].text
    stops = [text[1:end] for end in range(3, 40) if "\ufffd" not in text[1:end]]
    assert len(stops) >= 5
    for stop in stops:
        params = greedy(60, stop=[stop])
        expected, got = (llm.generate([want], params)[0].outputs[0] for llm in (base, spec))
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason), stop
    assert spec.stats().spec_decode_num_accepted_tokens > 0


def test_logprobs_of_accepted_drafts_and_their_replacements(llama_dir, reference) -> None:
    """Each token's logprob row (its own, its rank, the top 3) is the one a token a step
    gives: accepted drafts' rows, the row of a token drawn in a rejected draft's place, and
    the sampler's row after a fully accepted run."""
    base = LLM(llama_dir, dtype="float32", max_model_len=256)
    spec = LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = greedy(logprobs=3)
    expected, got = (llm.generate(prompts(), params) for llm in (base, spec))
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs)
        for row_a, row_b in zip(a.logprobs, b.logprobs, strict=True):
            assert list(row_b) == list(row_a)  # the token first, then the top 3 in order
            for token_id, entry in row_a.items():
                assert row_b[token_id].rank == entry.rank
                assert abs(row_b[token_id].logprob - entry.logprob) < 1e-4
        assert abs(b.cumulative_logprob - a.cumulative_logprob) < 1e-3
    stats = spec.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 0.8}, {"frequency_penalty": -0.4, "presence_penalty": -0.3},
    {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
], ids=["repetition", "frequency_presence", "discouraging"])
def test_penalties_count_the_drafts_before_each_row(llama_dir, penalties) -> None:
    """Penalties that favour repeats (drafts accepted, each row counting the drafts before it)
    and ones that discourage them (drafts rejected): outputs as a token a step gives."""
    base = LLM(llama_dir, dtype="float32", max_model_len=256)
    spec = LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    params = greedy(**penalties)
    expected, got = ([o.outputs[0].token_ids for o in llm.generate(prompts(), params)]
                     for llm in (base, spec))
    assert got == expected
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if penalties.get("repetition_penalty", 1.0) < 1.0 or penalties.get("presence_penalty", 0) < 0:
        assert stats.spec_decode_num_accepted_tokens > 0


def test_n_completions_speculate_each(llama_dir, reference) -> None:
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    out = llm.generate(prompts()[:1], SamplingParams(n=3, temperature=0.0, max_tokens=40,
                                                     ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [reference[0]] * 3
    random = llm.generate(prompts()[:1], SamplingParams(n=3, temperature=1.0, max_tokens=40,
                                                        ignore_eos=True))[0]
    assert all(len(c.token_ids) == 40 for c in random.outputs)
    assert llm.stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16},
    {"num_kv_blocks": 20, "block_size": 8, "max_model_len": 80},
], ids=["default", "16_token_chunks", "forced_preemption"])
@pytest.mark.parametrize("draft", ["itself", "another"])
def test_greedy_is_the_same_with_a_draft_model(llama_dir, model_dir_factory, reference,
                                               settings, draft) -> None:
    """A draft model drafts on the target's block tables: the target itself (its drafts all
    accepted, but for rounding in near-ties) or another model of its vocabulary (most
    rejected); greedy as without drafts either way, prefix hits and preemption included.
    (A draft as costly as its target never pays: the cost policy is lifted, as in every
    test here.)"""
    draft_dir = llama_dir if draft == "itself" else model_dir_factory("llama", seed=7)
    llm = LLM(llama_dir, dtype="float32", speculative_config={
        "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
        **{"max_model_len": 256, **settings})
    for _ in range(2):
        outs = llm.generate(prompts(), greedy())
        assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert drafted > 0
    if draft == "itself":
        assert accepted >= 0.9 * drafted
    else:
        assert accepted < drafted
    if "num_kv_blocks" in settings:
        assert stats.num_preemptions > 0


def test_a_draft_model_of_another_vocabulary_is_refused(llama_dir, model_dir_factory) -> None:
    other = model_dir_factory("llama", vocab_size=509)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config={
            "method": "draft_model", "model": str(other)})
    with pytest.raises(SpeculativeConfigError, match="model directory"):
        LLM(llama_dir, dtype="float32", max_model_len=256, speculative_config={
            "method": "draft_model", "model": "/nonexistent/draft"})
