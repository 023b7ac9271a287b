"""Greedy output equals HF transformers token for token (float32), whatever the schedule:
small token budgets (chunked prefill), a KV cache so small that requests are preempted and
recomputed, prefix-cache hits, one sequence at a time — for every supported architecture, with
async scheduling (the default) and without."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_models import hf_greedy, load_hf_model

from aserve import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [3, 7, 16, 17, 31, 40, 55, 64]
NUM_NEW = 32


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, model_dir_factory):
    """The model dir, its prompts, and HF's greedy continuations with raw logits."""
    model_dir = model_dir_factory(request.param)
    model = load_hf_model(model_dir)
    prompts = make_prompts(model.config.vocab_size)
    outputs, logits = hf_greedy(model, prompts, NUM_NEW, with_logits=True)  # logits [NUM_NEW, V]
    return model_dir, prompts, outputs, logits


def greedy(**extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NUM_NEW, "ignore_eos": True,
                             **extra})


def generate_ids(llm: LLM, prompts: list[list[int]], params=None) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy())
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf(reference):
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32")
    assert generate_ids(llm, prompts) == expected


def test_greedy_matches_hf_with_chunked_prefill_budget_16(reference):
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16)
    assert generate_ids(llm, prompts) == expected


def test_greedy_matches_hf_under_preemption(reference):
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32", max_model_len=128, num_kv_blocks=12, block_size=16)
    assert generate_ids(llm, prompts) == expected
    assert llm.stats().num_preemptions > 0


def test_greedy_matches_hf_without_async_scheduling(reference):
    """The default (above) overlaps scheduling with the forward; the plain loop must agree too,
    under chunking and preemption."""
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32", max_model_len=128, num_kv_blocks=12, block_size=16,
              max_num_batched_tokens=24, async_scheduling=False)
    assert generate_ids(llm, prompts) == expected
    assert llm.stats().num_preemptions > 0


def test_greedy_matches_hf_with_prefix_cache_hits(reference):
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32", block_size=4)
    assert generate_ids(llm, prompts) == expected
    hits_before = llm.stats().prefix_cache_hits
    assert generate_ids(llm, prompts) == expected
    assert llm.stats().prefix_cache_hits > hits_before


def test_greedy_matches_hf_one_sequence_at_a_time(reference):
    model_dir, prompts, expected, _ = reference
    llm = LLM(model_dir, dtype="float32", max_num_seqs=1)
    assert generate_ids(llm, prompts) == expected


def test_top5_logprobs_close_to_hf(reference):
    """Tolerance: 1e-4 absolute on float32 logprobs (the two implementations order their
    float32 reductions differently; observed differences are ~1e-6)."""
    model_dir, prompts, expected, hf_logits = reference
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(logprobs=5))
    for out, hf_ids, logits in zip(outputs, expected, hf_logits):
        completion = out.outputs[0]
        assert completion.token_ids == hf_ids
        hf_logprobs = torch.log_softmax(logits, dim=-1)  # [NUM_NEW, vocab]
        for step, entry in enumerate(completion.logprobs):
            top = hf_logprobs[step].topk(5)
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert token_id in entry
                assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
            sampled = completion.token_ids[step]
            assert entry[sampled].rank == 1


def test_prompt_logprobs_match_hf_across_chunks(reference):
    model_dir, prompts, _, _ = reference
    model = load_hf_model(model_dir)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           greedy(prompt_logprobs=2, max_tokens=1))
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)  # [len, vocab]
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            assert entry[prompt[i]].logprob == pytest.approx(
                expected[i - 1, prompt[i]].item(), abs=1e-4)
