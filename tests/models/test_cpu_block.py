"""A decoder layer as one C++ call (`aserve.backends.cpu_block`) against the module-by-module
forward: the same kernels in the same order, so tokens AND logprobs must be bit-identical, for a
plain Llama and for Qwen2's q/k/v biases, also in steps where a long chunk sends the layer back to
its modules (SDPA). Skipped where aserve's AVX512-BF16 GEMM is not built."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from aserve import LLM, SamplingParams
from aserve.backends import CpuPlatform, cpu_block
from aserve.kernels import cpu_attention

pytestmark = pytest.mark.usefixtures("cpu_gemm_kernel")  # skips where it is not built


def _run(model_dir, prompts, params) -> list:
    # No measured prefill cap: both runs must chunk alike (a chunk's length picks its kernels).
    with LLM(model_dir, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64,
             max_prefill_step_ratio=0) as llm:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch,long_chunk", [("llama", None), ("qwen2", None), ("llama", 20)])
def test_cpu_block_is_bit_identical_to_the_module_forward(arch, long_chunk, model_dir_factory,
                                                          monkeypatch):
    model_dir = model_dir_factory(arch)
    if long_chunk is not None:  # chunks longer than this go to SDPA: those steps run modules
        monkeypatch.setattr(cpu_attention, "plan_tiles",
                            functools.partial(cpu_attention.plan_tiles, long_chunk=long_chunk))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]}
               for n in (5, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    ran = []  # per call: whether the block ran the step (False: it left it to the modules)
    call = cpu_block.CpuDecoderBlock.__call__

    def counted(self, *args):
        out = call(self, *args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(cpu_block.CpuDecoderBlock, "__call__", counted)
    fused = _run(model_dir, prompts, params)
    assert any(ran)
    assert all(ran) == (long_chunk is None)
    kernel_ops = CpuPlatform.kernel_ops  # the same kernels, without the whole-layer call
    monkeypatch.setattr(CpuPlatform, "kernel_ops", lambda self, dtype: dataclasses.replace(
        kernel_ops(self, dtype), decoder_layer=None))
    ran.clear()
    modular = _run(model_dir, prompts, params)
    assert not ran
    assert fused == modular
