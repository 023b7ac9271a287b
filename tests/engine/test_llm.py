"""The offline API end to end: sampling, n > 1, stop strings, text, errors that lose nothing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from aserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_dir_factory):
    return LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [11 + i] * (3 + i)} for i in range(15)]
    batch = others[:7] + [prompt] + others[7:]
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 16
    params[7] = seeded
    in_batch = llm.generate(batch, params)[7].outputs[0].token_ids
    assert in_batch == alone
    other_seed = llm.generate([prompt], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(model_dir_factory):
    model_dir = model_dir_factory("llama")
    prompts = [{"prompt_token_ids": [3 + i] * (20 + 3 * i)} for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(6)]
    roomy = LLM(model_dir, dtype="float32", max_model_len=96)
    tight = LLM(model_dir, dtype="float32", max_model_len=96, num_kv_blocks=8, block_size=16)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.stats().num_preemptions > 0


def test_n_greater_than_one_returns_n_completions(llm):
    out = llm.generate(["Hello! How are you?"],
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                      ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(["Hello! How are you?"],
                          SamplingParams(n=2, temperature=0.0, max_tokens=12))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_text_is_the_tokenizers_decode_of_the_tokens(llm, model_dir_factory):
    hf_tok = AutoTokenizer.from_pretrained(model_dir_factory("llama"))
    prompts = ["The quick brown fox", "中文文本测试：你好", "Emoji 😀🎉 make"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                   ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == hf_tok(prompt)["input_ids"]
        completion = out.outputs[0]
        assert completion.text == hf_tok.decode(completion.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_and_is_reported(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["Hello! How are you?"], params)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate(["Hello! How are you?"], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate(["Hello! How are you?"], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens_finish_reasons(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    full = llm.generate(["Hello"], params)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=10,
                                                 ignore_eos=True, stop_token_ids=[stop_id]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == full.token_ids[:first + 1]


def test_bad_requests_raise_and_the_engine_keeps_serving(llm):
    ok = SamplingParams(temperature=0.0, max_tokens=5)
    before = llm.generate(["Hello"], ok)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate([{"prompt_token_ids": [5] * 300}], ok)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(["Hello", {"prompt_token_ids": [5, 10**6]}], ok)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["Hello"], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="top_k"):
        llm.generate(["Hello"], SamplingParams(top_k=10**6))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], ok)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    assert llm.generate(["Hello"], ok)[0].outputs[0].token_ids == before
    assert not llm.engine_core.has_unfinished_requests()
    assert llm.stats().kv_cache_usage == 0.0


def test_missing_model_directory_names_the_file(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        LLM(str(tmp_path))
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-dir"):
        LLM(str(tmp_path / "no-such-dir"))


def test_bfloat16_generates(model_dir_factory):
    llm = LLM(model_dir_factory("qwen3"), dtype="bfloat16")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.spawns
def test_cli_generates_offline(model_dir_factory):
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--model", model_dir_factory("llama"),
         "--prompt", "Hello", "--max-tokens", "6", "--dtype", "float32", "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "Hello" and len(line["token_ids"]) == 6


def test_n_completions_share_the_prompt_blocks(model_dir_factory):
    llm = LLM(model_dir_factory("llama"), dtype="float32", block_size=16)
    prompt = {"prompt_token_ids": list(range(3, 67))}  # 64 tokens: 3 full blocks reusable
    llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4))
    # children 2..4 find the first child's 3 full prompt blocks (the last block is recomputed)
    assert llm.stats().prefix_cache_hits == 3 * 48


def test_step_token_budget_defaults_to_the_platforms(llm, model_dir_factory):
    from aserve.backends.cpu import CpuPlatform

    budget = CpuPlatform.default_max_num_batched_tokens
    assert llm.engine_core.scheduler.config.max_num_batched_tokens == budget
    with LLM(model_dir_factory("llama"), dtype="float32", max_model_len=256,
             max_num_batched_tokens=64) as small:
        assert small.engine_core.scheduler.config.max_num_batched_tokens == 64
        long_prompt = {"prompt_token_ids": [7] * 150}  # prefilled in three chunks
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        want = llm.generate([long_prompt], greedy)
        got = small.generate([long_prompt], greedy)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_the_context_is_checked_once_and_max_tokens_defaults_to_what_it_leaves(llm):
    """The processor is the one place: a prompt that fills the context is refused, a null
    max_tokens becomes what the context leaves (on the engine's copy, not the user's params),
    offline a max_tokens past the context stops there (vLLM's LLM), and the server's strict
    processor refuses it naming max_tokens (vLLM's server)."""
    from aserve.engine.processor import ContextLengthError, Processor

    processor = llm.processor
    prompt = processor.process_prompt({"prompt_token_ids": [5] * 200})
    user = SamplingParams(max_tokens=None, ignore_eos=True)
    prepared = processor.prepare(prompt, user)
    assert prepared.params.max_tokens == 56 and user.max_tokens is None
    out = llm.generate({"prompt_token_ids": [5] * 250},
                       SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (6, "length")
    with pytest.raises(ContextLengthError, match="maximum context length is 256 tokens"):
        llm.generate({"prompt_token_ids": [5] * 256})
    strict = Processor(llm.tokenizer, llm.model_info, strict_max_tokens=True)
    with pytest.raises(ContextLengthError, match=r"requested 270 tokens \(250 in the messages"
                       ) as info:
        strict.prepare(strict.process_prompt({"prompt_token_ids": [5] * 250}),
                       SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens"


def test_engine_state_lives_on_the_engine_request_not_on_the_users_params(llm):
    """The model's EOS ids and the compiled constraint go on the engine's `Request`; the
    user's `SamplingParams` keep only what the user set (and compare equal after a run)."""
    from aserve.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    before = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    processor = llm.processor
    prepared = processor.prepare(processor.process_prompt("Hi"), params)
    _, (request,) = processor.make_requests("r", prepared)
    assert request.eos_token_ids == llm.model_info.eos_token_ids
    assert request.grammar is prepared.grammar is not None
    assert set(llm.model_info.eos_token_ids) <= request.stop_token_ids
    assert llm.generate("Hi", params)[0].outputs[0].text in ("yes", "no")
    assert params == before
    user_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert not user_fields & {"eos_token_ids", "compiled_grammar", "grammar"}


FREEZE_SCRIPT = """
import gc, sys
from aserve import LLM, SamplingParams

def frozen(obj):  # the permanent generation is not among gc.get_objects()'s
    return not any(o is obj for o in gc.get_objects())

kept = [bytearray(3)]  # alive before any engine: part of the startup heap
assert not frozen(kept)
first = LLM(sys.argv[1], dtype="float32", max_model_len=64)
assert frozen(kept) and gc.get_freeze_count() > 1000
later = [bytearray(3)]
second = LLM(sys.argv[1], dtype="float32", max_model_len=64)
assert not frozen(later)  # a second engine counts itself in, but freezes nothing more
first.shutdown()
assert frozen(kept)  # the second engine still holds the freeze
out = second.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 4
second.shutdown()
assert not frozen(kept) and gc.get_freeze_count() == 0  # the last one thawed everything
print("ok")
"""


@pytest.mark.spawns
def test_warm_engines_freeze_the_startup_heap_until_the_last_shuts_down(model_dir_factory):
    # A full collection otherwise walks every import, module and weight again: ~200 ms of
    # the whole process stalled on a 2-core host (benchmarks/studies/gc_heap.py). In a clean
    # process: the suite's own engines hold freezes of their own.
    result = subprocess.run([sys.executable, "-c", FREEZE_SCRIPT, model_dir_factory("llama")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
