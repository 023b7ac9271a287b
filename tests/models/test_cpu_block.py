"""A decoder layer as one C++ call, and the whole stack of them as one
(`aserve.backends.cpu_block`), against the module-by-module forward: the same kernels in the same
order, so tokens AND logprobs must be bit-identical, for a plain Llama and for Qwen2's q/k/v
biases, also in steps where a long chunk sends the layers back to their modules (SDPA). Skipped
where aserve's AVX512-BF16 GEMM is not built."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from aserve import LLM, SamplingParams
from aserve.backends import CpuPlatform, cpu_block
from aserve.kernels import cpu_attention

pytestmark = pytest.mark.usefixtures("cpu_layer_kernel")  # skips where it is not built


def _run(model_dir, prompts, params) -> list:
    # No measured prefill cap: both runs must chunk alike (a chunk's length picks its kernels).
    with LLM(model_dir, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64,
             max_prefill_step_ratio=0) as llm:
        outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch,long_chunk", [("llama", None), ("qwen2", None), ("llama", 20)])
def test_cpu_block_and_stack_are_bit_identical_to_the_module_forward(arch, long_chunk,
                                                                     model_dir_factory,
                                                                     monkeypatch):
    model_dir = model_dir_factory(arch)
    if long_chunk is not None:  # chunks longer than this go to SDPA: those steps run modules
        monkeypatch.setattr(cpu_attention, "plan_tiles",
                            functools.partial(cpu_attention.plan_tiles, long_chunk=long_chunk))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]}
               for n in (5, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    ran = {"stack": [], "block": []}  # per call: whether it ran the step (False: left it)

    def counting(cls, key):
        call = cls.__call__

        def counted(self, *args):
            out = call(self, *args)
            ran[key].append(out is not None)
            return out
        monkeypatch.setattr(cls, "__call__", counted)

    counting(cpu_block.CpuDecoderStack, "stack")
    counting(cpu_block.CpuDecoderBlock, "block")
    stacked = _run(model_dir, prompts, params)  # the default: every layer in one call
    assert any(ran["stack"])
    assert all(ran["stack"]) == (long_chunk is None)
    assert not any(ran["block"])  # a layer takes no step that its stack left
    kernel_ops = CpuPlatform.kernel_ops

    def without(**fields):  # the same kernels, without the stack (and the layer) call
        monkeypatch.setattr(CpuPlatform, "kernel_ops", lambda self, dtype: dataclasses.replace(
            kernel_ops(self, dtype), **fields))
        for calls in ran.values():
            calls.clear()
        return _run(model_dir, prompts, params)

    layered = without(decoder_stack=None)
    assert not ran["stack"] and any(ran["block"])
    assert all(ran["block"]) == (long_chunk is None)
    modular = without(decoder_stack=None, decoder_layer=None)
    assert not ran["stack"] and not ran["block"]
    assert stacked == layered == modular
