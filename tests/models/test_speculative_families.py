"""Greedy with n-gram drafts equals HF transformers' on every model family's tiny model —
sliding windows (their blocks freed behind the window while drafts roll back), mixtures of
experts, soft-caps — under 16-token chunks and small blocks; constrained requests speculate
within their grammars (every method); TP=2, PP=2 and SP=2 (slow; the draft model and EAGLE
heads under them: tests/parallel/test_speculative_layouts.py)."""

from __future__ import annotations

import json
import random

import pytest
from helpers.eagle_heads import make_eagle_head
from helpers.hf_models import MOE_CASES, SLIDING_CASES, hf_greedy

from aserve import LLM, SamplingParams
from aserve.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
NUM_NEW = 24
CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    **{name: SLIDING_CASES[name] for name in ("gemma2", "mistral", "qwen2")},
    **{name: MOE_CASES[name] for name in ("mixtral", "qwen3_moe")},
}


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat runs of themselves (drafts from the first step on) of lengths
    around the windows and the 16-token chunks."""
    rng = random.Random(3)
    out = []
    for n in (5, 9, 14, 21):
        run = [rng.randrange(3, 500) for _ in range(n)]
        out.append(run + run[: max(2, n // 2)])
    out.append([100, 200, 300] * 4)
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_drafts_matches_hf(model_dir_factory, tmp_path, monkeypatch, case,
                                       method) -> None:
    """Each method on each family: the lookups; the family's model as its own draft model
    (every draft accepted; a llama of its vocabulary beside a sliding-window family, whose
    layers a draft model may not have); an EAGLE-1 head on its embedding and LM head. The
    cost policy is lifted for the last two (drafts this size never pay)."""
    arch, overrides = CASES[case]
    model_dir = model_dir_factory(arch, **overrides)
    prompts = repeating_prompts()
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    own_draft = case not in SLIDING_CASES
    if method in ("draft_model", "eagle"):
        monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)
    spec = {"ngram": NGRAM, "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "num_speculative_tokens": 3,
                            "model": str(model_dir if own_draft
                                         else model_dir_factory("llama", seed=3))},
            "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(
                make_eagle_head(tmp_path / "head", model_dir, 1, seed=2))}}[method]
    settings = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 16,
                "long_prefill_token_threshold": 16, "block_size": 8, "speculative_config": spec}
    if case == "mistral" and method in ("draft_model", "eagle"):  # every layer slides: no
        with pytest.raises(ValueError, match="full-attention"):  # block table covers every
            LLM(model_dir, **settings)  # position for the drafter's own K/V
        return
    # HF's min_new_tokens masks EOS throughout; so does min_tokens here (drafts then stop
    # short of it, and the min_tokens mask applies to every draft row)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(model_dir, **settings) as llm:
        for _ in range(2):  # the second pass hits the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.prefix_cache_hits > 0
    if method == "draft_model" and own_draft:
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_constrained_requests_speculate_within_their_grammars(llama_dir, tmp_path, monkeypatch,
                                                              method) -> None:
    """Drafts of constrained requests are checked against the grammar row by row (a refused
    one is rejected): greedy replies as without drafts, every request constrained or every
    other one; a random reply is still valid JSON. Each method: the lookups, the target as
    its own draft model (its drafts ignore the grammar), an EAGLE head (the policy lifted:
    the drafters keep up at every step)."""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)
    spec = {"ngram": NGRAM, "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "model": str(llama_dir),
                            "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(
                make_eagle_head(tmp_path / "head", llama_dir, 1, seed=1))}}[method]
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                             "b": {"type": "string", "maxLength": 12}},
              "required": ["a", "b"]}
    constrained = SamplingParams(temperature=0.0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts()]
    batches = [[constrained] * len(prompts),
               [constrained if i % 2 else free for i in range(len(prompts))]]
    results = []
    for speculative in (None, spec):
        with LLM(llama_dir, dtype="float32", max_model_len=128,
                 speculative_config=speculative) as llm:
            results.append([[o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                            for params in batches])
            if speculative is not None:
                accepted = llm.stats().spec_decode_num_accepted_tokens
                sampled = llm.generate(prompts[:2], SamplingParams(
                    temperature=0.8, max_tokens=100,
                    structured_outputs=StructuredOutputsParams(json=schema)))
    assert results[1] == results[0]
    assert accepted > 0
    for out in sampled:
        assert out.outputs[0].finish_reason == "stop"
        reply = json.loads(out.outputs[0].text)
        assert isinstance(reply["a"], int) and len(reply["b"]) <= 12


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2},
                                    {"sequence_parallel_size": 2}], ids=["tp2", "pp2", "sp2"])
@pytest.mark.parametrize("spec", [NGRAM, {"method": "suffix", "num_speculative_tokens": 4}],
                         ids=["ngram", "suffix"])
def test_parallel_layouts_with_drafts_match_hf(model_dir_factory, layout, spec) -> None:
    model_dir = model_dir_factory("llama")
    prompts = repeating_prompts()
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLM(model_dir, dtype="float32", max_model_len=128, block_size=8,
             speculative_config=spec, **layout) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.stats().spec_decode_num_accepted_tokens > 0


def test_a_draft_model_beside_a_hybrid_target(model_dir_factory, monkeypatch) -> None:
    """A target with a sliding-window group (gemma2): the draft model (a llama of its
    vocabulary) reads the full-attention group's tables; greedy as HF's. A draft model with
    sliding windows, or a target without a full-attention group, is refused. (The cost
    policy is lifted: a draft this size never pays.)"""
    monkeypatch.setattr("aserve.core.spec_policy.worthwhile_drafts", lambda k, *_: k)
    arch, overrides = SLIDING_CASES["gemma2"]
    target = model_dir_factory(arch, **overrides)
    draft = model_dir_factory("llama", seed=3)
    prompts = repeating_prompts()
    expected = hf_greedy(target, prompts, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(target, dtype="float32", max_model_len=128, block_size=8, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.stats().spec_decode_num_draft_tokens > 0
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(draft, dtype="float32", max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(target)})
    arch, overrides = SLIDING_CASES["mistral"]  # every layer slides
    with pytest.raises(ValueError, match="full-attention"):
        LLM(model_dir_factory(arch, **overrides), dtype="float32", max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(draft)})
