"""The hybrid KV cache end to end: a model's layers are grouped by window, layers of different
groups share KV buffers (so a sliding window saves real memory), sliding groups hold about
their window per request, and an all-sliding model serves sequences several times longer than
its whole cache — greedy-equal to HF transformers, without preemption."""

from __future__ import annotations

import random

from helpers.hf_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.core.kv_cache_utils import make_kv_cache_groups


def greedy(num_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)


def test_gemma2_layers_form_two_groups_over_one_shared_buffer(gemma2_dir):
    llm = LLM(gemma2_dir, dtype="float32", num_kv_blocks=300, block_size=4)
    core = llm.engine_core
    assert [(g.sliding_window, g.layers) for g in core.kv_cache_groups] == [(None, (1,)),
                                                                           (10, (0,))]
    runner = core.executor.worker.runner
    assert len(runner.kv_caches) == 1  # layer 0 (sliding) and layer 1 (full) share buffer 0
    layers = runner.model.attention_layers()
    assert [(a.kv_group, a.sliding_window) for a in layers] == [(1, 10), (0, None)]
    assert layers[0].kv_cache is layers[1].kv_cache


def test_a_window_halves_the_bytes_of_a_block(gemma2_dir, model_dir_factory):
    """Same budget, same shapes: the hybrid Gemma-2 gets twice the blocks of a model whose
    two layers both attend fully (each block is one layer's K/V instead of two)."""
    budget = 1 << 20
    hybrid = LLM(gemma2_dir, dtype="float32", kv_cache_memory=budget, max_num_seqs=64)
    full = LLM(model_dir_factory("gemma2", sliding_window=None, layer_types=[
        "full_attention", "full_attention"]), dtype="float32", kv_cache_memory=budget,
        max_num_seqs=64)
    assert len(full.engine_core.kv_cache_groups) == 1
    assert hybrid.engine_core.num_blocks == 2 * full.engine_core.num_blocks


def test_an_all_sliding_model_serves_a_sequence_four_times_its_cache(sliding_dir_factory):
    """Mistral, every layer W=7: 24 blocks of 4 tokens hold 92 tokens (block 0 is the null
    block); a 150-token prompt plus 230 new tokens is 380, and the sliding group frees each
    block the window has passed, so the request never runs out of blocks."""
    model_dir = sliding_dir_factory("mistral")
    rng = random.Random(3)
    prompt = [rng.randrange(3, 512) for _ in range(150)]
    expected = hf_greedy(model_dir, [prompt], 230)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=24, block_size=4,
              max_num_batched_tokens=16, max_model_len=512)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(230))[0].outputs[0]
    assert out.token_ids == expected[0]
    assert len(prompt) + len(out.token_ids) > 4 * 23 * 4
    assert llm.stats().num_preemptions == 0


def test_sliding_groups_hold_a_flat_number_of_blocks(sliding_dir_factory):
    """Qwen2 with layer 0 full and layers 1-2 sliding (W=13): while a request decodes, its full
    group grows with the sequence and its sliding groups stay at the window's blocks."""
    model_dir = sliding_dir_factory("qwen2")
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=16, max_model_len=128)
    core, held = llm.engine_core, []
    groups = make_kv_cache_groups(core.model_info.layer_windows, 4)
    # one full layer, two sliding ones: groups of one layer (one KV buffer for all three)
    assert core.kv_cache_groups == groups
    assert [g.sliding_window for g in groups] == [None, 13, 13]
    core.add_request(_request(list(range(3, 43)), greedy(60)))
    kv = core.scheduler.kv_cache_manager
    while core.has_work():
        core.step()
        if core.scheduler.running:
            ids = kv.get_block_ids(core.scheduler.running[0].request_id)
            held.append([sum(1 for b in g if b != 0) for g in ids])
    full = [h[0] for h in held]
    assert full[-1] == -(-(40 + 60 - 1) // 4) and full == sorted(full)
    window_blocks = -(-(13 - 1 + 16) // 4) + 1  # the window and a 16-token step
    assert all(max(h[1:]) <= window_blocks for h in held)
    decoding = [h[1:] for h in held[-40:]]  # 40 decode steps: the sliding groups stay flat
    assert all(d == decoding[0] for d in decoding) and max(decoding[0]) <= -(-13 // 4) + 1


def _request(prompt: list[int], params: SamplingParams):
    from aserve.core.request import Request

    return Request("r0", prompt, params)
