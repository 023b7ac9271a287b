"""bfloat16 on CPU: greedy tokens are the same whatever the schedule.

The AVX512-BF16 kernels compute each row on its own in a fixed order: a GEMM row's sums do not
depend on the rows beside it, and an attention query's scores, softmax and value sums depend only
on its own keys (a decode row and the same position inside a prefill chunk run the same
arithmetic). So alone, in a batch, chunked in 24-token steps, from a prefix-cache hit or after
preemption, a request gets bit-identical logits — hence identical greedy tokens, which bf16
through other kernels (HF's, oneDNN's) would not promise. Skipped where those kernels are not
built (no AVX512-BF16).
"""

from __future__ import annotations

import random

import pytest

from aserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_layer_kernel")  # skips where it is not built

PROMPT_LENS = [5, 17, 31, 40, 64, 70]
NUM_NEW = 24


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "mixtral", "qwen2_moe"])
def test_bf16_greedy_is_the_same_under_any_schedule(arch, model_dir_factory, moe_dir_factory):
    """Mixtures of experts too: the fused CPU MoE sums each token's experts in a fixed order,
    whichever rows share an expert's GEMM."""
    is_moe = arch in ("mixtral", "qwen2_moe")
    model_dir = moe_dir_factory(arch) if is_moe else model_dir_factory(arch)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]}
               for n in PROMPT_LENS]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)

    with LLM(model_dir, dtype="bfloat16", max_model_len=128) as llm:
        alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
        llm.reset_prefix_cache()
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        cached = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]  # prefix hits
    with LLM(model_dir, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=24,
             num_kv_blocks=14, block_size=16) as small:
        squeezed = [o.outputs[0].token_ids for o in small.generate(prompts, greedy)]
        assert small.stats().num_preemptions > 0

    assert together == alone
    assert cached == alone
    assert squeezed == alone
