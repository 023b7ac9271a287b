"""GGUF files served directly (`aserve/models/gguf_checkpoint.py`), on the float reference
path: tiny HF models written as GGUF the way llama.cpp's converter writes them
(`helpers/gguf_models.py`), for each architecture served and each quant type, greedy-equal
token for token to HF transformers holding the file's weights as llama.cpp's own package
dequantizes them; the file's tokenizer, chat template and special tokens equal those it was
made from; a bad file is one clear error naming what and where.
"""

from __future__ import annotations

import struct

import pytest
import torch
from helpers.gguf_models import hf_reference, write_gguf
from helpers.hf_models import SLIDING_CASES, hf_greedy
from helpers.parity import generate_ids

from aserve import LLM
from aserve.engine.tokenizer import Tokenizer
from aserve.quantization.gguf_file import gguf_model_dir

PROMPTS = [[5, 17, 33, 90, 4, 61, 7, 250, 11, 42, 43, 44, 45], [100, 200, 300]]  # past W
K_QUANT_MODEL = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # 256-wide rows


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))


def greedy_parity(hf_dir, path) -> None:
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    assert generate_ids(llm, PROMPTS, 12) == hf_greedy(hf_reference(hf_dir, path), PROMPTS, 12)


# Gemma as llama.cpp can write it: attention scale 1/sqrt(head_dim) (its 27B sizes aside), and
# for Gemma-3 the layer pattern, both rope bases and the linear factor in the file's keys
GEMMA2 = dict(query_pre_attn_scalar=16, sliding_window=10, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0)
GEMMA3 = {**SLIDING_CASES["gemma3"][1], "query_pre_attn_scalar": 16, "rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}}  # a base that shows
# Llama 3.1+'s rope scaling, which a GGUF keeps as a factor per frequency (`rope_freqs`): two
# of the 8 frequencies on the curve between 1 and the factor
LLAMA3_ROPE = dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
# Mixtures of experts as llama.cpp keeps them: every layer sparse, experts stacked per kind;
# Qwen2-MoE unnormalised with a gated shared expert, Qwen3-MoE renormalised
MIXTRAL = dict(num_local_experts=5, num_experts_per_tok=2)
QWEN2_MOE = dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                 moe_intermediate_size=64, shared_expert_intermediate_size=96,
                 norm_topk_prob=False)
QWEN3_MOE = dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=64,
                 norm_topk_prob=True)
CASES = [("mixtral", "Q8_0", MIXTRAL), ("qwen2_moe", "Q4_0", QWEN2_MOE),
         ("qwen3_moe", "Q5_0", QWEN3_MOE), ("llama", "Q8_0", LLAMA3_ROPE), ("llama", "F16", {}),
         ("llama", "Q4_K", K_QUANT_MODEL), ("qwen2", "Q8_0", {}), ("qwen3", "Q4_0", {}),
         ("mistral", "Q5_1", {}), ("gemma2", "Q8_0", GEMMA2), ("gemma3", "Q4_1", GEMMA3)]
SLOW_CASES = [("llama", q, {}) for q in ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")] + [
    ("llama", q, K_QUANT_MODEL) for q in ("Q2_K", "Q3_K", "Q5_K", "Q6_K")] + [
    ("qwen2", "Q6_K", K_QUANT_MODEL), ("qwen3", "Q8_0", {}), ("qwen3", "Q4_K", K_QUANT_MODEL)]


@pytest.mark.parametrize("arch, qtype, overrides", CASES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES],
    ids=lambda v: v if isinstance(v, str) else "")
def test_a_gguf_file_is_greedy_equal_to_hf_on_its_dequantized_weights(
        model_dir_factory, tmp_path, arch, qtype, overrides):
    hf_dir = model_dir_factory(arch, **overrides)
    path = write_gguf(hf_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    greedy_parity(hf_dir, path)


def test_the_parity_is_discriminating(model_dir_factory, tmp_path):
    """Q4_0 changes HF's own greedy output (so the dequantized weights are what is compared),
    and llama's Q / K rows are stored permuted (so un-permuting them is tested)."""
    import transformers

    hf_dir = model_dir_factory("llama")
    path = write_gguf(hf_dir, tmp_path / "q4.gguf", "Q4_0")
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    quantized = hf_reference(hf_dir, path)
    ids = torch.tensor([PROMPTS[0]])
    assert not torch.allclose(original(ids).logits, quantized(ids).logits, atol=1e-3)
    import gguf

    q = next(t for t in gguf.GGUFReader(str(write_gguf(hf_dir, tmp_path / "f32.gguf")))
             .tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(q.data.copy())
    assert not torch.equal(stored, original.model.layers[0].self_attn.q_proj.weight.detach())


def test_its_tokenizer_template_and_special_tokens_are_the_models(model_dir_factory, tmp_path):
    from helpers.hf_models import make_tool_model

    hf_dir = make_tool_model(tmp_path / "tools")  # added tokens, special and not
    path = write_gguf(hf_dir, tmp_path / "tools.gguf", "Q8_0")
    ours, original = Tokenizer.from_dir(gguf_model_dir(path)), Tokenizer.from_dir(hf_dir)
    for text in ["Hello world", "<|im_start|>user\nhi 12345<|im_end|>", "<tool_call>\n{}",
                 "  spaces\tand\nnew lines ünïcode 🙂", ""]:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(original.encode(text)) == original.decode(original.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == original.apply_chat_template(messages)
    assert ours.eos_token_id == original.eos_token_id


def test_a_sentencepiece_vocabulary_tokenizes_as_hfs_llama_tokenizer(tmp_path):
    """llama.cpp's `llama` vocabulary (scores, byte tokens, no merges) as HF's Llama / Mistral
    tokenizer.json runs it: byte fallback, "▁" spaces, the BOS in front."""
    import shutil

    from helpers.gguf_models import write_spm_tokenizer
    from helpers.hf_models import make_hf_model

    hf_dir = make_hf_model(tmp_path / "spm", "llama")
    write_spm_tokenizer(hf_dir)
    path = write_gguf(hf_dir, tmp_path / "spm.gguf", "Q8_0")
    ours, original = Tokenizer.from_dir(gguf_model_dir(path)), Tokenizer.from_dir(hf_dir)
    for text in ["The cat sat on the mat", " leading space", "two  spaces\nand a line",
                 "ünïcode 🙂 falls back to bytes", "12345", ""]:
        assert ours.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == original.decode(
            ids, skip_special_tokens=True)
    assert ours.encode("x")[0] == 1  # <s>
    shutil.rmtree(hf_dir)


def test_the_server_names_a_gguf_model_as_given(model_dir_factory, tmp_path):
    from aserve.engine.arg_utils import EngineArgs

    path = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.gguf", "Q8_0")
    args = EngineArgs(model=str(path))
    assert args.served_model_name == str(path)
    assert (gguf_model_dir(path) / "config.json").is_file()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(path.read_bytes())
    assert EngineArgs(model=str(folder)).served_model_name == str(folder)


# ------------------------------------------------------------------------------ bad files

def test_a_truncated_file_is_one_error_naming_it(model_dir_factory, tmp_path):
    path = write_gguf(model_dir_factory("llama"), tmp_path / "whole.gguf", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 3])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        gguf_model_dir(cut)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 64)
    with pytest.raises(ValueError, match="garbage.gguf is not a readable GGUF file"):
        gguf_model_dir(garbage)


def write_custom(path, arch="llama", tokenizer="gpt2", qtype=None):
    """A minimal GGUF of one tensor: an architecture, tokenizer or quant type of our choice."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(["a", "b"])
    if qtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    else:
        qt = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = np.zeros((2, 256 // block * size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind, match", [
    ({"arch": "phi3"}, "architecture 'phi3' is not served"),
    ({"qtype": "IQ4_NL"}, "token_embd.weight"),
    ({"tokenizer": "t5"}, "tokenizer 't5' is not supported"),
])
def test_what_is_not_served_is_one_error_naming_it(tmp_path, kind, match):
    path = write_custom(tmp_path / "odd.gguf", **kind)
    with pytest.raises(ValueError, match=match):
        gguf_model_dir(path)


@pytest.mark.spawns
def test_the_cli_refuses_a_bad_file_with_one_line_and_exit_1(tmp_path):
    import subprocess
    import sys

    path = write_custom(tmp_path / "odd.gguf", arch="phi3")
    out = subprocess.run([sys.executable, "-m", "aserve", "--model", str(path)],
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "ASERVE_CACHE": str(tmp_path)})
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "phi3" in out.stderr


def test_the_load_log_says_what_the_weights_were(model_dir_factory, tmp_path, caplog):
    import logging

    path = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.gguf", "Q8_0")
    logger = logging.getLogger("aserve.models.loader")  # (its own handler: another test may
    logger.addHandler(caplog.handler)                    # have stopped "aserve" propagating)
    try:
        with caplog.at_level(logging.INFO, logger="aserve.models.loader"):
            LLM(model=str(path), dtype="float32", max_model_len=64)
    finally:
        logger.removeHandler(caplog.handler)
    assert f"weights: GGUF {path}" in caplog.text
    assert "(Q8_0 x16, F32 x5)" in caplog.text  # 2 layers x 7 linears, embedding, LM head
    assert "dequantized to float32" in caplog.text


def test_rope_factors_that_follow_no_llama3_rule_are_refused(model_dir_factory, tmp_path):
    import gguf
    import numpy as np

    path = write_gguf(model_dir_factory("llama", **LLAMA3_ROPE), tmp_path / "r.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path), "r+")
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    factors[:] = np.array([1.0, 3.0, 1.5, 8.0, 2.0, 8.0, 8.0, 8.0], dtype=np.float32)
    del reader
    with pytest.raises(ValueError, match="does not follow Llama 3's rope scaling"):
        gguf_model_dir(path)


def test_v1_models_names_the_gguf_file_as_its_root(model_dir_factory, tmp_path):
    import httpx
    from helpers.server import serving

    from aserve.engine.arg_utils import EngineArgs
    from aserve.server import build_app

    path = write_gguf(model_dir_factory("llama"), tmp_path / "tiny.gguf", "Q8_0")
    with serving(build_app(EngineArgs(model=str(path), dtype="float32", max_model_len=64))) as url:
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
    assert card["id"] == str(path) and card["root"] == str(path.resolve())
    assert card["quantization"] == "GGUF (Q8_0 x16, F32 x5); dequantized to float32"
