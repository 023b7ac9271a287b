"""What the greedy-parity test files share: HF's reference run of a tiny model (prompts, greedy
continuations, logits), a variant of its HF model with a config key changed (to show that a
feature changes HF's output), and aserve's greedy run of the same prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from aserve import LLM, SamplingParams
from helpers.hf_models import HF_ATTENTION, hf_greedy, load_hf_model

PROMPT_LENS = [20, 37, 60]
NUM_NEW = 32


@dataclass
class Reference:
    name: str
    model_dir: Path
    prompts: list[list[int]]
    outputs: list[list[int]]  # HF's greedy continuations
    logits: list[torch.Tensor]  # HF's raw logits of each step, [NUM_NEW, vocab] per prompt


def hf_reference(name: str, model_dir: Path, prompt_lens: list[int] = PROMPT_LENS,
                 num_new: int = NUM_NEW) -> Reference:
    """HF's greedy run (float32) of random prompts (seed 0) of these lengths."""
    model = load_hf_model(model_dir)
    rng = random.Random(0)
    vocab = model.config.get_text_config().vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lens]
    outputs, logits = hf_greedy(model, prompts, num_new, with_logits=True)
    return Reference(name, model_dir, prompts, outputs, logits)


def hf_variant(model_dir: Path, **text_config):
    """HF's model of `model_dir` with its (text) config changed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in text_config.items():
        setattr(config.get_text_config(), key, value)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                attn_implementation=HF_ATTENTION).eval()


def greedy(num_new: int = NUM_NEW, **extra) -> SamplingParams:
    """Exactly `num_new` greedy tokens, EOS banned until then: `hf_greedy`'s min_new_tokens
    (`ignore_eos` would let EOS be chosen, which HF's run never does)."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": num_new, "min_tokens": num_new,
                             **extra})


def generate_ids(llm: LLM, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(num_new))
    return [o.outputs[0].token_ids for o in outputs]


def next_token_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """The log-probability of each token of `sequences` after the ones before it."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.tensor([entry[token].logprob for s, out in zip(sequences, outs, strict=True)
                         for token, entry in zip(s[1:], out.prompt_logprobs[1:], strict=True)])


def scores_as_reference(path, prompts: list[list[int]], **fast) -> tuple[float, float, LLM]:
    """How far a fast path's scoring of text strays from the float32 reference's: the mean
    |log-probability difference| of the reference's own greedy continuations of `prompts`,
    for `LLM(path, **fast)` and for plain bf16 (`dtype="bfloat16", dequantize=True`), and the
    fast LLM (still running: the caller looks inside, then shuts it down)."""
    reference = LLM(model=str(path), dtype="float32", max_model_len=256, warmup=False)
    sequences = [p + ids for p, ids in zip(prompts, generate_ids(reference, prompts, 12),
                                            strict=True)]
    expected = next_token_logprobs(reference, sequences)
    reference.engine_core.shutdown()
    assert expected.abs().mean() > 1.0  # the text is not trivially predictable
    bf16 = LLM(model=str(path), dtype="bfloat16", dequantize=True, max_model_len=256,
               warmup=False)
    bf16_error = (next_token_logprobs(bf16, sequences) - expected).abs().mean().item()
    bf16.engine_core.shutdown()
    llm = LLM(model=str(path), max_model_len=256, warmup=False, **fast)
    error = (next_token_logprobs(llm, sequences) - expected).abs().mean().item()
    return error, bf16_error, llm


def _check_default(ref: Reference) -> None:
    assert generate_ids(LLM(ref.model_dir, dtype="float32"), ref.prompts) == ref.outputs


def _check_chunked_prefill_16(ref: Reference) -> None:
    llm = LLM(ref.model_dir, dtype="float32", max_num_batched_tokens=16)
    assert generate_ids(llm, ref.prompts) == ref.outputs


def _check_preemption(ref: Reference) -> None:
    """A cache two blocks above what one maximal request holds at once (over every KV cache
    group): the requests cannot all run."""
    from aserve.core.kv_cache_utils import blocks_per_request, make_kv_cache_groups
    from aserve.models.loader import read_arch_config

    groups = make_kv_cache_groups(read_arch_config(ref.model_dir).layer_windows, 16)
    num_blocks = blocks_per_request(groups, 128, 16) + 2 + 1  # + the null block
    llm = LLM(ref.model_dir, dtype="float32", max_model_len=128, num_kv_blocks=num_blocks,
              block_size=16, max_num_batched_tokens=16)
    assert generate_ids(llm, ref.prompts) == ref.outputs
    assert llm.stats().num_preemptions > 0


def _check_one_sequence(ref: Reference) -> None:
    llm = LLM(ref.model_dir, dtype="float32", max_num_seqs=1)
    assert generate_ids(llm, ref.prompts) == ref.outputs


def _check_no_prefix_cache(ref: Reference) -> None:
    llm = LLM(ref.model_dir, dtype="float32", enable_prefix_caching=False,
              max_num_batched_tokens=24, async_scheduling=False)
    assert generate_ids(llm, ref.prompts) == ref.outputs


def _check_prefix_cache_hits(ref: Reference) -> None:
    llm = LLM(ref.model_dir, dtype="float32", block_size=4)
    assert generate_ids(llm, ref.prompts) == ref.outputs
    hits_before = llm.stats().prefix_cache_hits
    assert generate_ids(llm, ref.prompts) == ref.outputs
    assert llm.stats().prefix_cache_hits > hits_before


# name -> a check that aserve's greedy run of `ref` under that schedule is HF's
SCHEDULE_CHECKS = {
    "default": _check_default,
    "chunked_prefill_16": _check_chunked_prefill_16,
    "preemption": _check_preemption,
    "one_sequence": _check_one_sequence,
    "no_prefix_cache": _check_no_prefix_cache,
    "prefix_cache_hits": _check_prefix_cache_hits,
}
