"""aserve on torch_xla's PJRT CPU device (`--device xla` without an accelerator): greedy output
equals HF transformers on CPU token for token, under chunked prefill and on prefix-cache hits;
each step's graph is cut (the KV cache holds data, not a growing trace); seeded sampling repeats.

Needs torch_xla, which pins its own torch: `scripts/xla_check.sh` builds a venv and runs these.
Skipped where torch_xla is not installed (the default suite). The number of XLA graphs compiled
is printed (`-rP` shows it).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from helpers.hf_models import hf_greedy

from aserve import LLM, SamplingParams

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla loads: bit-parity needs the CPU
torch_xla = pytest.importorskip("torch_xla")
from torch_xla.debug import metrics  # noqa: E402

PROMPT_LENS = [3, 9, 17, 30, 41]  # 30 and 41 are prefilled in chunks under a 16-token budget
NUM_NEW = 12
TOKEN_BUDGET = 16

@pytest.fixture(scope="module")
def reference(model_dir_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The llama dir, prompts of varied lengths, and HF's greedy continuations on CPU."""
    model_dir = model_dir_factory("llama")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    return model_dir, prompts, expected


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def num_compiled_graphs() -> int:
    return metrics.counter_value("UncachedCompile") or 0


def test_greedy_on_xla_cpu_matches_hf_with_chunked_prefill_and_prefix_hits(reference):
    model_dir, prompts, expected = reference
    metrics.clear_all()
    llm = LLM(str(model_dir), dtype="float32", device="xla",
              max_num_batched_tokens=TOKEN_BUDGET)
    first = generate_ids(llm, prompts, greedy())
    graphs_first = num_compiled_graphs()
    hits_before = llm.stats().prefix_cache_hits
    second = generate_ids(llm, prompts, greedy())  # the same prompts: prefix-cache hits
    compile_time = metrics.metric_data("CompileTime")
    print(f"XLA graphs compiled: {graphs_first} on the first pass, "
          f"{num_compiled_graphs()} after the second (prefix hits); CompileTime "
          f"{compile_time[1] / 1e9 if compile_time else 0:.1f} s in all")
    assert first == expected
    assert second == expected
    assert llm.stats().prefix_cache_hits > hits_before


def test_kv_cache_holds_device_data_after_each_step_not_a_growing_trace(reference):
    """Without a graph cut per step, each step's graph also recomputes every earlier step's KV
    writes: outputs stay right while compiling gets slower every step."""
    model_dir, prompts, _ = reference
    llm = LLM(str(model_dir), dtype="float32", device="xla")
    generate_ids(llm, prompts[:2], greedy())
    kv_caches = llm.engine_core.executor.worker.runner.kv_caches
    assert kv_caches
    for kv_cache in kv_caches:
        info = torch_xla._XLAC._get_xla_tensor_debug_info(kv_cache)
        assert "IR: None" in info, f"the KV cache is still a pending trace:\n{info}"


def test_seeded_sampling_on_xla_repeats_and_stays_in_the_vocabulary(reference):
    model_dir, prompts, _ = reference
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed)
              for seed in (1, 1, 2)]
    unseeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=8,
                              ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", device="xla")
    seeded = [generate_ids(llm, prompts[1:2], p)[0] for p in params]
    free = generate_ids(llm, prompts[:3], unseeded)
    vocab_size = llm.model_info.vocab_size
    assert seeded[0] == seeded[1] != seeded[2]
    assert all(0 <= t < vocab_size for ids in [*seeded, *free] for t in ids)
    assert [len(ids) for ids in free] == [8, 8, 8]
