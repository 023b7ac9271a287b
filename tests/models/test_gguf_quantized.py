"""GGUF files on the quantized fast path: with --dtype bfloat16 (the default for them) the
linear weights stay as integers for the VNNI GEMM (`cpu_qgemm.QuantPackedWeight`), inside the
whole-layer C++ call, and the model scores text as its float reference does, within the
int8-activation error that llama.cpp's own Q8 dot products have. `--dequantize` keeps the bf16
path. (Token-for-token parity with HF is the float reference's: tests/models/test_gguf.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_models import write_gguf
from helpers.parity import scores_as_reference

from aserve import LLM
from aserve.backends.cpu_block import CpuDecoderBlock
from aserve.kernels import cpu_qgemm
from aserve.kernels.cpu_gemm import PackedWeight
from aserve.kernels.cpu_qgemm import QuantPackedWeight

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(),
                                reason="the CPU or build lacks AVX512-VNNI / BF16")

PROMPTS = [[5, 17, 33, 90, 4, 61, 7, 250, 11, 42, 43, 44, 45], [100, 200, 300]]
K_QUANT_MODEL = dict(hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.engine_core.executor.worker.runner.model


def packed_kinds(llm: LLM) -> set[type]:
    return {type(m.packed_weight) for m in model_of(llm).modules()
            if getattr(m, "packed_weight", None) is not None}


@pytest.mark.parametrize("arch, qtype, overrides", [
    ("llama", "Q4_1", {}), ("qwen2", "Q8_0", {}), ("llama", "Q4_K", K_QUANT_MODEL),
    ("llama", "Q5_K", K_QUANT_MODEL),  # (K-quants of 256-wide rows: their own two levels)
    pytest.param("mistral", "Q6_K", K_QUANT_MODEL, marks=pytest.mark.slow),
    pytest.param("llama", "Q3_K", K_QUANT_MODEL, marks=pytest.mark.slow),
    pytest.param("qwen3", "Q5_0", {}, marks=pytest.mark.slow)])
def test_the_fast_path_keeps_integers_and_scores_as_the_float_reference(
        model_dir_factory, tmp_path, arch, qtype, overrides):
    hf_dir = model_dir_factory(arch, **overrides)
    path = write_gguf(hf_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    error, bf16_error, fast = scores_as_reference(path, PROMPTS, dtype="bfloat16")
    assert packed_kinds(fast) == {QuantPackedWeight}  # every linear, the LM head too
    if qtype.endswith("_K"):  # (rows of whole 256-input blocks: the K-quant's own two levels)
        assert all(m.packed_weight.two_levels for m in model_of(fast).modules()
                   if getattr(m, "packed_weight", None) is not None)
    layer = model_of(fast).model.layers[0]
    if getattr(layer.self_attn, "q_norm", None) is None:  # (qwen3's q/k norms run in Python)
        assert CpuDecoderBlock.of(layer) is not None  # the whole-layer C++ call takes them
    fast.engine_core.shutdown()
    # int8 activations in groups cost about what bf16 activations do, never a broken weight's
    # error (a weight's rows or groups misplaced moves these log-probabilities by whole nats)
    assert error < max(4 * bf16_error, 0.02), (error, bf16_error)


def test_dequantize_keeps_the_bf16_path(model_dir_factory, tmp_path):
    path = write_gguf(model_dir_factory("llama"), tmp_path / "q.gguf", "Q8_0")
    llm = LLM(model=str(path), dtype="bfloat16", dequantize=True, max_model_len=64,
              warmup=False)
    assert packed_kinds(llm) == {PackedWeight}
    llm.engine_core.shutdown()


def test_v1_models_and_the_log_say_what_runs_quantized(model_dir_factory, tmp_path, caplog):
    import logging

    import httpx
    from helpers.server import serving

    from aserve.engine.arg_utils import EngineArgs
    from aserve.server import build_app

    path = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.gguf", "Q4_0")
    logger = logging.getLogger("aserve.backends.cpu_ops")  # (its own handler, as in
    logger.addHandler(caplog.handler)                       # test_gguf.py's log test)
    try:
        with caplog.at_level(logging.INFO, logger="aserve.backends.cpu_ops"), serving(build_app(
                EngineArgs(model=str(path), dtype="bfloat16", max_model_len=64,
                           quantization="gguf"))) as url:
            [card] = httpx.get(f"{url}/v1/models").json()["data"]
    finally:
        logger.removeHandler(caplog.handler)
    # 2 layers x 4 packed linears, the LM head, and the embedding (untied: its own rows)
    assert card["quantization"] == ("GGUF (Q4_0 x16, F32 x5); integer GEMM: "
                                    "int4 g32 sym x9 linear weights, the rest bfloat16")
    assert "10 of 10 linear weights kept as integers (int4 g32 sym x10)" in caplog.text


@pytest.mark.parametrize("requested, match", [
    ("gptq", "does not match the checkpoint's quantization method 'gguf'"),
    ("bitsandbytes", "not a method aserve reads")])
def test_a_quantization_the_checkpoint_has_not_is_refused(model_dir_factory, tmp_path,
                                                         requested, match):
    path = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.gguf", "Q8_0")
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="bfloat16", quantization=requested, max_model_len=64)
    with pytest.raises(ValueError, match="not quantized"):
        LLM(model=str(model_dir_factory("llama")), dtype="bfloat16", quantization="awq",
            max_model_len=64)


MOE_CASES = [  # as tests/models/test_gguf.py's mixtures of experts
    ("mixtral", "Q8_0", dict(num_local_experts=5, num_experts_per_tok=2)),
    ("qwen2_moe", "Q4_0", dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                               moe_intermediate_size=64, shared_expert_intermediate_size=96,
                               norm_topk_prob=False)),
    ("mixtral", "Q5_K", dict(num_local_experts=4, num_experts_per_tok=2, **K_QUANT_MODEL)),
]


@pytest.mark.parametrize("arch, qtype, overrides", MOE_CASES)
def test_experts_keep_their_integers_too(model_dir_factory, tmp_path, arch, qtype, overrides):
    from aserve.kernels.cpu_qgemm import QuantFusedMoE
    from aserve.layers.moe import FusedMoE

    path = write_gguf(model_dir_factory(arch, **overrides), tmp_path / f"{arch}.gguf", qtype)
    error, bf16_error, fast = scores_as_reference(path, PROMPTS, dtype="bfloat16")
    experts = [m for m in model_of(fast).modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(m._run, QuantFusedMoE) for m in experts)
    if qtype.endswith("_K"):  # (the experts' packs in two levels, in the one C++ call)
        assert all(m._run.w13[0].two_levels for m in experts)
        # (the one call is AVX512-VNNI's; AVX2 runs the experts' loop over the same packs)
        assert all((m._run.stacked is not None) == cpu_qgemm.vnni() for m in experts)
    assert all(m.w13_weight.numel() == 0 for m in experts)  # no float copy kept
    fast.engine_core.shutdown()
    assert error < max(4 * bf16_error, 0.02), (error, bf16_error)
