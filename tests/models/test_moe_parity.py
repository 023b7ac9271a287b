"""Mixtures of experts (Mixtral with 5 experts, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE with every other layer sparse, gpt-oss with sinks, biased clamped experts, windowed
and full layers and YaRN) generate HF transformers' greedy tokens (float32)
whatever the schedule and the layout: chunked prefill, preemption, one sequence at a time, no
prefix cache, prefix-cache hits, TP=2 (every expert sliced), TP=2 with expert parallelism (whole
experts per rank, 5 = 3 + 2 for Mixtral) and its all-to-all combine.

Each model is discriminating: routing one expert fewer per token (and, for Qwen, flipping the
renormalisation; for gpt-oss, lifting its clamp, window or sinks) changes HF's output, and its
greedy runs are varied.
"""

from __future__ import annotations

import pytest
from helpers.hf_models import MOE_CASES, hf_greedy, load_hf_model
from helpers.parity import SCHEDULE_CHECKS, Reference, generate_ids, hf_reference, hf_variant

from aserve import LLM
from aserve.models.loader import read_arch_config


@pytest.fixture(scope="module", params=list(MOE_CASES))
def reference(request, moe_dir_factory) -> Reference:
    return hf_reference(request.param, moe_dir_factory(request.param))


def test_routing_changes_hf_greedy_output_which_is_varied(reference):
    """One expert fewer per token changes HF's output; so does flipping Qwen's renormalisation
    (Mixtral always renormalises, gpt-oss never), and for gpt-oss lifting its clamp or its
    window."""
    assert all(len(set(out)) >= 5 for out in reference.outputs), reference.outputs
    moe = read_arch_config(reference.model_dir).moe
    variants = [{"num_experts_per_tok": moe.top_k - 1}]
    if reference.name.startswith("qwen"):
        variants.append({"norm_topk_prob": not moe.renormalize})
    if reference.name == "gpt_oss":
        variants += [{"swiglu_limit": 100.0}, {"sliding_window": 4096}]
    for change in variants:
        changed = hf_greedy(hf_variant(reference.model_dir, **change), reference.prompts,
                            len(reference.outputs[0]))
        assert sum(a != b for a, b in zip(changed, reference.outputs, strict=True)) >= 2, change


def test_gpt_oss_attention_sinks_change_hf_output(moe_dir_factory):
    import torch

    ref = hf_reference("gpt_oss", moe_dir_factory("gpt_oss"))
    model = load_hf_model(ref.model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that never weighs
    changed = hf_greedy(model, ref.prompts, len(ref.outputs[0]))
    assert sum(a != b for a, b in zip(changed, ref.outputs, strict=True)) >= 2


@pytest.mark.parametrize("schedule", list(SCHEDULE_CHECKS))
def test_greedy_matches_hf_under_any_schedule(reference, schedule):
    SCHEDULE_CHECKS[schedule](reference)


PARALLEL = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "tp2-ep-all-to-all": dict(tensor_parallel_size=2, enable_expert_parallel=True,
                              moe_combine="all-to-all"),
}


@pytest.mark.spawns
@pytest.mark.parametrize("layout", list(PARALLEL))
def test_greedy_matches_hf_in_parallel(reference, layout):
    with LLM(reference.model_dir, dtype="float32", max_num_batched_tokens=24,
             **PARALLEL[layout]) as llm:
        assert generate_ids(llm, reference.prompts) == reference.outputs
