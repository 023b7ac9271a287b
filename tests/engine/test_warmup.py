"""The engine's warm-up (`EngineCore._warm_up`): two dummy prompts run before it serves. It
teaches the step-cost model steps of more than one size and leaves nothing else behind: no
cached blocks, no counters, no steps in the log, the same greedy tokens as an engine without it."""

from __future__ import annotations

from aserve import LLM, SamplingParams


def _engine(llm: LLM):
    return llm.engine_core, llm.engine_core.scheduler


def test_warm_up_learns_the_step_costs_and_leaves_nothing_behind(model_dir_factory):
    with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256,
             max_num_batched_tokens=64) as llm:
        core, scheduler = _engine(llm)
        a, b = scheduler.step_cost.fit()
        assert a > 0 and b > 0  # steps of 1 and 33 tokens: both costs known
        assert core.num_steps == 0 and core.forward_seconds == 0.0
        assert core.step_log.snapshot() == []
        assert not scheduler.requests and not scheduler.running and not scheduler.waiting
        kv = scheduler.kv_cache_manager
        assert kv.block_pool.cached_blocks == {}
        assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks
        stats = core.stats()
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)


def test_warm_up_changes_no_output(model_dir_factory):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs, hits = {}, {}
    for warmup in (True, False):
        with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256,
                 max_num_batched_tokens=64, warmup=warmup) as llm:
            vocab = llm.model_info.vocab_size  # the warm-up's own first prompt among them:
            prompts = [{"prompt_token_ids": [(7919 * t + 1) % vocab for t in range(n)]}
                       for n in (64, 32, 9)]
            outs = llm.generate(prompts, params)
            outputs[warmup] = [o.outputs[0].token_ids for o in outs]
            hits[warmup] = llm.engine_core.stats().prefix_cache_hits  # (32 is 64's prefix)
    assert outputs[True] == outputs[False]
    assert hits[True] == hits[False]  # nothing of the warm-up's prompt was cached


def test_without_warm_up_the_step_costs_start_unknown(model_dir_factory):
    with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256,
             warmup=False) as llm:
        assert llm.engine_core.scheduler.step_cost.fit() is None


def test_a_cache_too_small_to_spare_skips_the_warm_up(model_dir_factory):
    # 9 blocks of 16 tokens: one 128-token request (max_model_len), nothing beside it.
    with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=128, num_kv_blocks=9,
             block_size=16) as llm:
        assert llm.engine_core.scheduler.step_cost.fit() is not None  # a smaller warm-up ran
    with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=16, num_kv_blocks=2,
             block_size=16) as llm:
        assert llm.engine_core.scheduler.step_cost.fit() is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
