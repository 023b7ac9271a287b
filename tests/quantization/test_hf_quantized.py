"""Quantized HF checkpoints on the float reference path (`aserve/quantization/hf_checkpoint.py`):
a tiny Llama's linear weights written as each method stores them — FP8 with block scales
(`weight_block_size`) or one per tensor, compressed-tensors FP8 / int8 per channel, int4
pack-quantized per group of 32, GPTQ (with and without act-order) and AWQ, 4-bit asymmetric in
groups of 32 — is greedy-equal token for token to HF transformers holding the
same weights dequantized here, independently; the scales sit in another shard than their weight
in one case; a method, format or bit width aserve cannot read is one error naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_models import hf_greedy
from helpers.parity import generate_ids
from safetensors.torch import load_file, save_file

from aserve import LLM

PROMPTS = [[5, 17, 33, 90, 4, 61, 7, 250], [100, 200, 300]]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn
BLOCK = 32
GROUP = 32


def fp8_block(w):
    """[out, in] -> (fp8 weight, scale_inv per BLOCK x BLOCK block)."""
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(FP8).reshape(rows, cols)
    deq = (q.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
           * scale[:, None, :, None]).reshape(rows, cols)
    return {"weight": q, "weight_scale_inv": scale}, deq


def fp8_tensor(w):
    scale = w.abs().max() / 448.0
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale.reshape(1), "input_scale": torch.ones(1)}, \
        q.float() * scale


def fp8_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def int8_channel(w):
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def int4_packed(w):
    """compressed-tensors pack-quantized, 4 bits, symmetric, one scale per GROUP inputs: codes
    -8..7 stored + 8, eight to an int32, the first in the lowest bits."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 7.0
    codes = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(rows, cols)
    unsigned = (codes + 8).to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i in range(8):
        words |= unsigned[..., i] << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    deq = codes.reshape(rows, cols // GROUP, GROUP) * scale[..., None]
    return ({"weight_packed": words, "weight_scale": scale,
             "weight_shape": torch.tensor([rows, cols])}, deq.reshape(rows, cols))


def group_codes(w, g_idx, groups):
    """Asymmetric 4-bit codes of [out, in] `w` whose input i is in group g_idx[i]: (codes,
    zeros [groups, out], float16 scales [groups, out], the dequantized weight)."""
    rows, cols = w.shape
    codes = torch.zeros(rows, cols, dtype=torch.int64)
    zeros = torch.zeros(groups, rows, dtype=torch.int64)
    scales = torch.zeros(groups, rows)
    for k in range(groups):
        members = g_idx == k
        part = w[:, members]
        low, high = part.amin(dim=1), part.amax(dim=1)
        scale = ((high - low) / 15).clamp(min=1e-6).half().float()
        zero = torch.round(-low / scale).clamp(1, 15)
        codes[:, members] = torch.round(part / scale[:, None] + zero[:, None]).clamp(
            0, 15).long()
        zeros[k], scales[k] = zero.long(), scale
    deq = (codes - zeros[g_idx].T) * scales[g_idx].T
    return codes, zeros, scales.half(), deq


def gptq(w, act_order):
    from aserve.quantization.awq_gptq import pack_gptq

    g_idx = torch.arange(w.shape[1]) // GROUP
    if act_order:  # act-order: input rows in groups by a permutation
        g_idx = g_idx[torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(0))]
    codes, zeros, scales, deq = group_codes(w, g_idx, w.shape[1] // GROUP)
    qweight, qzeros, scales = pack_gptq(codes, zeros, scales, bits=4, zero_offset=1)
    return ({"qweight": qweight, "qzeros": qzeros, "scales": scales,
             "g_idx": g_idx.to(torch.int32)}, deq)


def awq(w):
    from aserve.quantization.awq_gptq import pack_awq

    codes, zeros, scales, deq = group_codes(w, torch.arange(w.shape[1]) // GROUP,
                                            w.shape[1] // GROUP)
    qweight, qzeros, scales = pack_awq(codes, zeros, scales, bits=4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, deq


def ct_config(fmt, num_bits, kind, strategy, group_size=None):
    weights = {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy,
               "group_size": group_size}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"]}


CASES = {
    "fp8-block": (fp8_block, {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "weight_block_size": [BLOCK, BLOCK]}),
    "fp8-tensor": (fp8_tensor, {"quant_method": "fp8", "activation_scheme": "static"}),
    "ct-fp8-channel": (fp8_channel, ct_config("float-quantized", 8, "float", "channel")),
    "ct-int8-channel": (int8_channel, ct_config("int-quantized", 8, "int", "channel")),
    "ct-int4-group": (int4_packed, ct_config("pack-quantized", 4, "int", "group", GROUP)),
    "gptq-act-order": (lambda w: gptq(w, True), {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq"}),
    "gptq": (lambda w: gptq(w, False), {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
        "sym": False}),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                  "zero_point": True}),
}


def quantized_copy(hf_dir: Path, out: Path, quantize, quant_config, split: bool = False):
    """`hf_dir` with its linear weights quantized; (the directory, the dequantized state)."""
    shutil.copytree(hf_dir, out)
    state = load_file(str(out / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEAR:
            parts, deq = quantize(value.float())
            stored.update({f"{module}.{k}": v for k, v in parts.items()})
            dequantized[name] = deq
        else:
            stored[name] = value
            dequantized[name] = value
    (out / "model.safetensors").unlink()
    if split:  # scales in a second shard, apart from their weights
        first = {k: v for k, v in stored.items() if "scale" not in k}
        second = {k: v for k, v in stored.items() if "scale" in k}
        save_file(first, str(out / "model-00001-of-00002.safetensors"))
        save_file(second, str(out / "model-00002-of-00002.safetensors"))
        index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                                **{k: "model-00002-of-00002.safetensors" for k in second}}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    return out, dequantized


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_is_greedy_equal_to_hf_on_its_dequantized_weights(
        model_dir_factory, tmp_path, case):
    import transformers

    hf_dir = model_dir_factory("llama")
    quantize, config = CASES[case]
    out, dequantized = quantized_copy(hf_dir, tmp_path / case, quantize, config,
                                      split=case == "fp8-block")
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    original_logits = reference(torch.tensor([PROMPTS[0]])).logits
    reference.load_state_dict(dequantized)
    assert not torch.allclose(original_logits, reference(torch.tensor([PROMPTS[0]])).logits,
                              atol=1e-4)  # quantizing changed the model: the test can tell
    llm = LLM(model=str(out), dtype="float32", max_model_len=256)
    assert generate_ids(llm, PROMPTS, 12) == hf_greedy(reference, PROMPTS, 12), case


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "bitsandbytes"}, "method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24'"),
    ({"quant_method": "gptq", "bits": 5}, "gptq with 5 bits"),
    ({"quant_method": "awq", "bits": 8}, "awq with 8 bits"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "marlin"),
    ("fp8", "quantization_config must be an object"),
])
def test_what_cannot_be_read_is_one_error_naming_it(model_dir_factory, tmp_path, quant, match):
    out = tmp_path / "q"
    shutil.copytree(model_dir_factory("llama"), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(out), dtype="float32", max_model_len=64)


INTEGER_CASES = ["ct-int8-channel", "ct-int4-group", "gptq", "gptq-act-order", "awq"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_integer_form_is_the_dequantized_weight(model_dir_factory, tmp_path, case):
    """What the integer kernels pack (`int_weight_source`) is the weight the float path
    loads (GPTQ's act-order with its columns sorted by group); fp8 has no integer form."""
    from aserve.quantization.hf_checkpoint import QuantizedCheckpoint

    quantize, config = CASES[case]
    out, dequantized = quantized_copy(model_dir_factory("llama"), tmp_path / case, quantize,
                                      config)
    with QuantizedCheckpoint(sorted(out.glob("*.safetensors")), config) as f:
        for module in ("self_attn.q_proj", "mlp.down_proj"):
            name = f"model.layers.0.{module}.weight"
            source = f.int_weight_source(name)
            weight = source() if source is not None else None
            if case not in INTEGER_CASES:
                assert weight is None
                continue
            assert weight.group == (32 if "group" in case or "gptq" in case or case == "awq"
                                    else dequantized[name].shape[1])
            torch.testing.assert_close(weight.dequantize(), dequantized[name].float(),
                                       rtol=1e-5, atol=1e-7)
            assert (weight.perm is not None) == (case == "gptq-act-order")
        assert f.int_weight_source("model.layers.0.input_layernorm.weight") is None


@pytest.mark.parametrize("case", INTEGER_CASES)
def test_integer_checkpoints_run_on_the_integer_gemm(model_dir_factory, tmp_path, case):
    """In bf16, GPTQ (act-order too: its inputs gathered in group order first) / AWQ /
    compressed-tensors int weights stay as integers for the integer GEMM and score text as the
    float reference does, in the whole-layer call where the build has it (act-order: its
    inputs gathered there)."""
    from helpers.parity import scores_as_reference

    from aserve.backends.cpu_block import CpuDecoderBlock
    from aserve.kernels import cpu_qgemm
    from aserve.kernels.cpu_qgemm import QuantPackedWeight

    if not cpu_qgemm.available():
        pytest.skip("the CPU or build lacks AVX512-VNNI and AVX2")
    quantize, config = CASES[case]
    out, _ = quantized_copy(model_dir_factory("llama"), tmp_path / case, quantize, config)
    error, bf16_error, fast = scores_as_reference(out, PROMPTS, dtype="bfloat16")
    layer = fast.engine_core.executor.worker.runner.model.model.layers[0]
    kinds = {type(m.packed_weight) for m in layer.modules()
             if getattr(m, "packed_weight", None) is not None}
    whole_layer = CpuDecoderBlock.of(layer)
    fast.engine_core.shutdown()
    assert kinds == {QuantPackedWeight}
    assert whole_layer is not None
    assert error < max(4 * bf16_error, 0.02), (error, bf16_error)


def test_act_order_in_the_whole_layer_call_is_the_module_forward_bit_for_bit(
        model_dir_factory, tmp_path, monkeypatch):
    """GPTQ's act-order inside the decoder stack's one C++ call: each linear's inputs gathered
    in its packed columns' order there, as its module does, so tokens and logprobs are the
    module-by-module forward's exactly (rows past a tile, prompts and decode)."""
    import dataclasses

    from aserve import SamplingParams
    from aserve.backends import CpuPlatform, cpu_block
    from aserve.kernels import cpu_qgemm

    if not cpu_qgemm.available():
        pytest.skip("the CPU or build lacks AVX512-VNNI and AVX2")
    quantize, config = CASES["gptq-act-order"]
    out, _ = quantized_copy(model_dir_factory("llama"), tmp_path / "ao", quantize, config)
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[0] * 5, PROMPTS[1], PROMPTS[0])]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    stack_calls = []
    call = cpu_block.CpuDecoderStack.__call__

    def counted(self, *args):
        result = call(self, *args)
        stack_calls.append(result is not None)
        return result
    monkeypatch.setattr(cpu_block.CpuDecoderStack, "__call__", counted)

    def run() -> list:
        with LLM(str(out), dtype="bfloat16", max_model_len=128) as llm:
            outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    stacked = run()
    assert stack_calls and all(stack_calls)
    kernel_ops = CpuPlatform.kernel_ops
    monkeypatch.setattr(CpuPlatform, "kernel_ops", lambda self, dtype: dataclasses.replace(
        kernel_ops(self, dtype), decoder_stack=None, decoder_layer=None))
    stack_calls.clear()
    assert run() == stacked and not stack_calls


def test_a_float16_quantized_checkpoint_runs_in_bfloat16_on_the_cpu(model_dir_factory, tmp_path):
    """GPTQ / AWQ configs say float16, whose CPU path packs nothing: with --dtype auto the
    model runs in bf16 (as vLLM's CPU build casts it), its weights on the integer GEMM."""
    from aserve.kernels import cpu_qgemm
    from aserve.kernels.cpu_qgemm import QuantPackedWeight

    quantize, config = CASES["awq"]
    out, _ = quantized_copy(model_dir_factory("llama"), tmp_path / "awq16", quantize, config)
    hf_config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "float16",
                                                  "dtype": "float16"}))
    llm = LLM(model=str(out), max_model_len=64, warmup=False)
    runner = llm.engine_core.executor.worker.runner
    kinds = {type(m.packed_weight) for m in runner.model.model.layers[0].modules()
             if getattr(m, "packed_weight", None) is not None}  # (its LM head is float)
    llm.engine_core.shutdown()
    assert runner.arch.dtype == torch.bfloat16
    if cpu_qgemm.available():
        assert kinds == {QuantPackedWeight}
    explicit = LLM(model=str(out), dtype="float16", max_model_len=64, warmup=False)
    assert explicit.engine_core.executor.worker.runner.arch.dtype == torch.float16
    explicit.engine_core.shutdown()
