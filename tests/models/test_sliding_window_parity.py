"""Sliding-window and hybrid models (Gemma-2, Gemma-3 and its multimodal checkpoint, Mistral
with a window of 7, Qwen2 with sliding layers from layer 1) generate HF transformers' greedy
tokens (float32) with prompts and generations longer than their windows, whatever the
schedule: chunked prefill, preemption, one sequence at a time, no prefix cache, prefix-cache
hits, tensor and pipeline parallelism.

Each model is discriminating: lifting its window (and, for Gemma-2, either soft-cap) changes
HF's output, and its greedy runs are varied.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_models import SLIDING_CASES, hf_greedy, load_hf_model
from helpers.parity import (
    NUM_NEW,
    PROMPT_LENS,
    SCHEDULE_CHECKS,
    Reference,
    generate_ids,
    greedy,
    hf_reference,
    hf_variant,
)

from aserve import LLM


@pytest.fixture(scope="module", params=list(SLIDING_CASES))
def reference(request, sliding_dir_factory) -> Reference:
    return hf_reference(request.param, sliding_dir_factory(request.param))


def test_the_window_changes_hf_greedy_output_which_is_varied(reference):
    assert all(len(set(out)) >= 5 for out in reference.outputs), reference.outputs
    unwindowed = hf_greedy(hf_variant(reference.model_dir, sliding_window=4096),
                           reference.prompts, NUM_NEW)
    assert all(a != b for a, b in zip(unwindowed, reference.outputs, strict=True))


@pytest.mark.parametrize("schedule", list(SCHEDULE_CHECKS))
def test_greedy_matches_hf_under_any_schedule(reference, schedule):
    SCHEDULE_CHECKS[schedule](reference)


@pytest.mark.spawns
def test_greedy_matches_hf_with_tensor_parallel_2(reference):
    with LLM(reference.model_dir, dtype="float32", tensor_parallel_size=2, block_size=4,
             max_num_batched_tokens=24) as llm:
        assert generate_ids(llm, reference.prompts) == reference.outputs


@pytest.mark.spawns
def test_greedy_matches_hf_with_pipeline_parallel_2(reference):
    """Two stages: (hidden, residual) cross between them, Gemma's as Llama's."""
    with LLM(reference.model_dir, dtype="float32", pipeline_parallel_size=2,
             max_num_batched_tokens=16) as llm:
        assert generate_ids(llm, reference.prompts) == reference.outputs


def test_gemma2_soft_caps_change_hf_output_and_logprobs_match(gemma2_dir):
    """Lifting the attention soft-cap changes the greedy tokens; the final one cannot (tanh is
    monotonic) but moves the logprobs, which aserve's follow to 1e-4."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    expected, hf_logits = hf_greedy(load_hf_model(gemma2_dir), prompts, NUM_NEW,
                                    with_logits=True)
    uncapped = hf_greedy(hf_variant(gemma2_dir, attn_logit_softcapping=None), prompts, NUM_NEW)
    assert all(a != b for a, b in zip(uncapped, expected, strict=True))
    _, uncapped_logits = hf_greedy(hf_variant(gemma2_dir, final_logit_softcapping=None),
                                   prompts, NUM_NEW, with_logits=True)
    llm = LLM(gemma2_dir, dtype="float32", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(logprobs=1))
    for out, want, logits, other in zip(outputs, expected, hf_logits, uncapped_logits,
                                        strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == want
        capped, uncapped_lp = (torch.log_softmax(x, dim=-1) for x in (logits, other))
        got = torch.tensor([entry[t].logprob for entry, t in zip(completion.logprobs, want)])
        chosen = torch.tensor(want)[:, None]
        torch.testing.assert_close(got, capped.gather(1, chosen)[:, 0], atol=1e-4, rtol=0)
        assert (uncapped_lp.gather(1, chosen)[:, 0] - got).abs().max() > 0.05
